//! Streaming (non-temporal) stores for results that will not be read again soon.
//!
//! A plain store to a cache line that is not in cache first reads the line from memory (a read
//! for ownership), so writing a large result moves every byte twice. When a collective's output is
//! larger than the caches, that read is pure waste: the next thing to touch the output is the
//! caller, long after the line has been evicted. Non-temporal stores write whole lines to memory
//! without reading them first and without evicting the working set. Inside the ring the gain is
//! smaller than in a plain copy, and on some machines a loss, which is why the engine uses them
//! only from the output size `RINGZERO_STREAM_STORES_FROM` sets (the measurements:
//! `docs/design-notes.md`, "Streaming stores").
//!
//! Only copies stream: a reduction that streams its combined tiles out runs slower than the plain
//! reduction and gains nothing inside the ring. Streaming stores are weakly ordered: call [`stream_fence`] before
//! another thread or process may read what they wrote.
//!
//! On other architectures the same functions use plain stores.

use crate::KernelError;

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
}
