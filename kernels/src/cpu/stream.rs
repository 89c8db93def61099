//! Streaming (non-temporal) stores for results that will not be read again soon.
//!
//! A plain store to a cache line that is not in cache first reads the line from memory (a read
//! for ownership), so writing a large result moves every byte twice. When a collective's output is
//! larger than the caches, that read is pure waste: the next thing to touch the output is the
//! caller, long after the line has been evicted. Non-temporal stores write whole lines to memory
//! without reading them first and without evicting the working set. On the 2-core EPYC VM this
//! project develops on, a 64 MiB buffer copied in 512 KiB pieces ran at ~7.7 GB/s with `memcpy`
//! and ~10.8 GB/s with 16-byte streaming stores; inside the ring the gain is smaller (see
//! `docs/design-notes.md`, "Streaming stores"), which is why only large outputs use them.
//!
//! The reductions here combine into a small tile in L1 first, then stream the tile to the result
//! and, when asked, copy it normally to a second destination that *will* be read soon (the next
//! rank's slot). Streaming stores are weakly ordered: call [`stream_fence`] before another thread
//! or process may read what they wrote.
//!
//! On other architectures the same functions use plain stores.

use crate::{DType, KernelError, ReduceOp};

use super::reduce::{divide, reduce_to};

/// Bytes combined per tile: small enough to stay in L1 next to the operands' lines.
const TILE: usize = 4096;

/// `dst.copy_from_slice(src)` with streaming stores where the CPU has them.
///
/// Errors (and changes nothing) when the lengths differ.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) -> Result<(), KernelError> {
    if dst.len() != src.len() {
        return Err(KernelError::LengthMismatch {
            kernel: "copy_streaming",
            left: dst.len(),
            right: src.len(),
        });
    }
    stream_bytes(dst, src);
    Ok(())
}

/// `out = a ⊕ b` (divided by `divide_by` when given: an `Avg`'s last combine), written to `out`
/// with streaming stores and, when `also` is given, to `also` with plain stores.
///
/// Errors (and changes nothing) when the lengths differ or a slice does not fit `dtype`.
#[allow(clippy::too_many_arguments)]
pub fn reduce_streaming(
    dtype: DType,
    op: ReduceOp,
    divide_by: Option<usize>,
    out: &mut [u8],
    a: &[u8],
    b: &[u8],
    mut also: Option<&mut [u8]>,
) -> Result<(), KernelError> {
    let es = dtype.size();
    for len in [a.len(), b.len()]
        .into_iter()
        .chain(also.as_ref().map(|x| x.len()))
    {
        if len != out.len() {
            return Err(KernelError::LengthMismatch {
                kernel: "reduce_streaming",
                left: out.len(),
                right: len,
            });
        }
    }
    if !out.len().is_multiple_of(es) {
        return Err(KernelError::BadLayout {
            kernel: "reduce_streaming",
            dtype,
            bytes: out.len(),
            addr: out.as_ptr() as usize,
        });
    }
    // Eight-byte aligned, so the tile suits every element type.
    let mut tile = [0u64; TILE / 8];
    let tile: &mut [u8] = bytemuck::cast_slice_mut(&mut tile);
    let mut at = 0;
    while at < out.len() {
        let len = (out.len() - at).min(TILE);
        let t = &mut tile[..len];
        reduce_to(dtype, op, t, &a[at..at + len], &b[at..at + len])?;
        if let Some(n) = divide_by {
            divide(dtype, t, n)?;
        }
        stream_bytes(&mut out[at..at + len], t);
        if let Some(x) = also.as_deref_mut() {
            x[at..at + len].copy_from_slice(t);
        }
        at += len;
    }
    Ok(())
}

/// Make every streaming store this thread issued visible before any later store (a slot's header,
/// a lock release) is: `sfence` on x86-64, nothing elsewhere (there the stores were plain).
pub fn stream_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` is part of SSE, which every x86-64 CPU has; it touches no memory.
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
}

#[cfg(target_arch = "x86_64")]
fn stream_bytes(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    debug_assert_eq!(dst.len(), src.len());
    // Plain stores up to the first 16-byte boundary of `dst`, and for the tail.
    let head = dst.as_ptr().align_offset(16).min(dst.len());
    dst[..head].copy_from_slice(&src[..head]);
    let body = (dst.len() - head) / 16 * 16;
    let (d, s) = (&mut dst[head..head + body], &src[head..head + body]);
    for (dc, sc) in d.chunks_exact_mut(16).zip(s.chunks_exact(16)) {
        // SAFETY: `sc` is 16 readable bytes (`chunks_exact`) and `loadu` needs no alignment; `dc`
        // is 16 writable bytes that start on a 16-byte boundary (`head` aligned the body and every
        // chunk is 16 bytes), which `_mm_stream_si128` requires. SSE2 is part of x86-64.
        unsafe {
            let v = _mm_loadu_si128(sc.as_ptr() as *const __m128i);
            _mm_stream_si128(dc.as_mut_ptr() as *mut __m128i, v);
        }
    }
    let done = head + body;
    dst[done..].copy_from_slice(&src[done..]);
}

#[cfg(not(target_arch = "x86_64"))]
fn stream_bytes(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::reduce::tests::encode;

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
            .collect()
    }

    #[test]
    fn streaming_copy_equals_a_plain_copy_at_every_misalignment() {
        let src = bytes(9000, 3);
        for off in 0..17 {
            for len in [0, 1, 15, 16, 17, 63, 4096, 8191] {
                let mut dst = vec![0u8; len + off];
                copy_streaming(&mut dst[off..], &src[..len]).unwrap();
                stream_fence();
                assert_eq!(&dst[off..], &src[..len], "offset {off}, length {len}");
                assert!(dst[..off].iter().all(|&b| b == 0), "wrote before the slice");
            }
        }
    }

    #[test]
    fn streaming_copy_refuses_mismatched_lengths_and_writes_nothing() {
        let mut dst = vec![9u8; 8];
        let e = copy_streaming(&mut dst, &[1u8; 7]).unwrap_err();
        assert!(e.to_string().contains("copy_streaming"), "{e}");
        assert_eq!(dst, vec![9u8; 8]);
    }

    #[test]
    fn streaming_reduce_matches_reduce_to_and_fills_both_outputs() {
        // Over several tiles, with a tail, for a 4-byte and a 2-byte type and an Avg's divide.
        for (dtype, n) in [
            (DType::F32, 3001usize),
            (DType::BF16, 5003),
            (DType::I64, 1029),
        ] {
            let es = dtype.size();
            let vals = |k: usize| -> Vec<f64> {
                (0..n)
                    .map(|i| ((i * 7 + k * 13) % 61) as f64 - 20.0)
                    .collect()
            };
            let (a, b) = (encode(dtype, &vals(1)), encode(dtype, &vals(2)));
            for div in [None, Some(2)] {
                let mut want = vec![0u8; n * es];
                reduce_to(dtype, ReduceOp::Sum, &mut want, &a, &b).unwrap();
                if let Some(d) = div {
                    divide(dtype, &mut want, d).unwrap();
                }
                let mut out = vec![0xAAu8; n * es];
                let mut also = vec![0x55u8; n * es];
                reduce_streaming(dtype, ReduceOp::Sum, div, &mut out, &a, &b, Some(&mut also))
                    .unwrap();
                stream_fence();
                assert_eq!(out, want, "{dtype:?} divide {div:?}");
                assert_eq!(also, want, "{dtype:?} divide {div:?}");
            }
        }
    }

    #[test]
    fn streaming_reduce_refuses_bad_lengths() {
        let mut out = vec![0u8; 8];
        let e = reduce_streaming(
            DType::F32,
            ReduceOp::Sum,
            None,
            &mut out,
            &[0u8; 8],
            &[0u8; 4],
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("reduce_streaming"), "{e}");
        let e = reduce_streaming(
            DType::F32,
            ReduceOp::Sum,
            None,
            &mut out[..6],
            &[0u8; 6],
            &[0u8; 6],
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("reduce_streaming"), "{e}");
        assert_eq!(out, vec![0u8; 8]);
    }
}
