//! Kernels on the floating-point training types (`f32`, `f16`, `bf16`): casts to and from `f32`,
//! scaling, the squared L2 norm, the inf/NaN check and the mixed-precision AdamW step (fp32 master
//! and moments, 16-bit parameters written from the master).
//!
//! 16-bit inputs are widened in blocks of [`HALF_BLOCK`] elements (bf16 by integer lanes, f16
//! through `half`'s slice conversions, which use F16C where the CPU has it), so the loops below
//! see `f32` slices.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::optim::{optim_step_inline, Optimizer};
use super::HALF_BLOCK;
use crate::Element;

/// A floating-point type parameters and gradients can be kept in.
pub trait Float: Element + Copy + Default {
    /// Whether this is `f32` itself (then a separate fp32 master copy is unnecessary).
    const IS_F32: bool;
    /// Widen `src` into `dst` (equal lengths).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Round `src` into `dst` (equal lengths), to nearest even.
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Float for f32 {
    const IS_F32: bool = true;
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Float for f16 {
    const IS_F32: bool = false;
    fn widen(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Float for bf16 {
    const IS_F32: bool = false;
    #[inline(always)]
    fn widen(src: &[bf16], dst: &mut [f32]) {
        bf16_widen(src, dst);
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [bf16]) {
        bf16_narrow(src, dst);
    }
}

/// bf16 → f32 as plain integer lanes (the top half of the f32's bits), so the loop inlines into
/// the dispatched step and runs in its vectors; the same bits as `half`'s conversion (a NaN is
/// made quiet).
#[inline(always)]
fn bf16_widen(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        let u = u32::from(s.to_bits());
        let u = if (u & 0x7fff) > 0x7f80 { u | 0x40 } else { u };
        *d = f32::from_bits(u << 16);
    }
}

/// f32 → bf16, to nearest even, written without branches so the loop vectorises: the bits of
/// `half`'s `bf16::from_f32` (a NaN keeps its top payload bits and is made quiet; rounding up
/// where the dropped half is above one half, or exactly one half and the kept bit odd).
#[inline(always)]
fn bf16_narrow(src: &[f32], dst: &mut [bf16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        let x = s.to_bits();
        let up = u32::from((x & 0x8000) != 0 && (x & 0x17fff) != 0);
        let nan = (x & 0x7fff_ffff) > 0x7f80_0000;
        let bits = if nan {
            (x >> 16) | 0x40
        } else {
            (x >> 16) + up
        };
        *d = bf16::from_bits(bits as u16);
    }
}

/// f16 → f32 with F16C's eight-lane conversion, inlined into the caller (the tail through
/// `half`). The same bits as `half`'s conversion, which uses F16C itself where the CPU has it.
///
/// # Safety
/// Only inside a function compiled with F16C and AVX enabled, called on a CPU that has them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16_widen_f16c(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    assert_eq!(src.len(), dst.len());
    let full = src.len() / 8 * 8;
    for i in (0..full).step_by(8) {
        // SAFETY: i + 8 ≤ len on both slices; unaligned loads and stores; the features are the
        // caller's (this function's contract).
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
    }
    src[full..].convert_to_f32_slice(&mut dst[full..]);
}

/// f32 → f16 to nearest even with F16C's eight-lane conversion, inlined into the caller (the
/// tail through `half`).
///
/// # Safety
/// As [`f16_widen_f16c`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16_narrow_f16c(src: &[f32], dst: &mut [f16]) {
    use std::arch::x86_64::{
        __m128i, _mm256_cvtps_ph, _mm256_loadu_ps, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };
    assert_eq!(src.len(), dst.len());
    let full = src.len() / 8 * 8;
    for i in (0..full).step_by(8) {
        // SAFETY: as in `f16_widen_f16c`.
        unsafe {
            let v = _mm256_loadu_ps(src.as_ptr().add(i));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm_storeu_si128(dst.as_mut_ptr().add(i).cast::<__m128i>(), h);
        }
    }
    dst[full..].convert_from_f32_slice(&src[full..]);
}

/// Widen a block of `T` for the step: f16 by F16C where `F16C` says the caller is compiled
/// with it, else `T::widen` (inlined: bf16's loop runs in the caller's vectors).
#[inline(always)]
fn widen_block<T: Float, const F16C: bool>(src: &[T], dst: &mut [f32]) {
    match T::DTYPE {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: F16C is true only in `step_mixed_avx2`, compiled with F16C and AVX2 and
        // called once the CPU is found to have both.
        crate::DType::F16 if F16C => unsafe { f16_widen_f16c(bytemuck::cast_slice(src), dst) },
        _ => T::widen(src, dst),
    }
}

/// Round a block of the master into `T` for the step ([`widen_block`]'s counterpart).
#[inline(always)]
fn narrow_block<T: Float, const F16C: bool>(src: &[f32], dst: &mut [T]) {
    match T::DTYPE {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `widen_block`.
        crate::DType::F16 if F16C => unsafe { f16_narrow_f16c(src, bytemuck::cast_slice_mut(dst)) },
        _ => T::narrow(src, dst),
    }
}

/// Run `f` over `src` widened to `f32`, one block at a time (`f` gets the block and its offset).
fn widened<T: Float>(src: &[T], mut f: impl FnMut(usize, &[f32])) {
    if T::IS_F32 {
        f(0, bytemuck::cast_slice(src));
        return;
    }
    let mut buf = [0f32; HALF_BLOCK];
    for (i, block) in src.chunks(HALF_BLOCK).enumerate() {
        let b = &mut buf[..block.len()];
        T::widen(block, b);
        f(i * HALF_BLOCK, b);
    }
}

/// Cast `src` into `dst` (any two float types; equal lengths), rounding to nearest even.
///
/// # Panics
/// If the lengths differ.
pub fn cast<A: Float, B: Float>(src: &[A], dst: &mut [B]) {
    assert_eq!(src.len(), dst.len(), "cast: lengths differ");
    widened(src, |off, x| B::narrow(x, &mut dst[off..off + x.len()]));
}

/// Multiply every element by `s` (in `f32`, rounded back once).
pub fn scale<T: Float>(buf: &mut [T], s: f32) {
    if T::IS_F32 {
        let b: &mut [f32] = bytemuck::cast_slice_mut(buf);
        b.iter_mut().for_each(|x| *x *= s);
        return;
    }
    let mut tmp = [0f32; HALF_BLOCK];
    for block in buf.chunks_mut(HALF_BLOCK) {
        let t = &mut tmp[..block.len()];
        T::widen(block, t);
        t.iter_mut().for_each(|x| *x *= s);
        T::narrow(t, block);
    }
}

/// Σ (x·s)² accumulated in `f64` (each product `x·s` rounded to `f32` first, as the optimizer
/// sees it). Infinite or NaN when any element is.
pub fn sq_norm<T: Float>(x: &[T], s: f32) -> f64 {
    let mut acc = 0f64;
    widened(x, |_, b| {
        acc += b.iter().map(|&v| ((v * s) as f64).powi(2)).sum::<f64>();
    });
    acc
}

/// Whether every element is finite (no inf, no NaN).
pub fn all_finite<T: Float>(x: &[T]) -> bool {
    let mut ok = true;
    widened(x, |_, b| ok &= b.iter().all(|v| v.is_finite()));
    ok
}

/// One optimizer step ([`optim_step`](super::optim_step)) on an fp32 `master` copy and fp32
/// states from gradients kept in `T` (multiplied by `grad_scale` first); then, unless `T` is
/// `f32` and `params` is absent, the updated master rounded into the `T` parameters.
/// Element-wise, so a shard computes what the whole would. A state the rule does not keep is an
/// empty slice. Runs in AVX2's vectors where the CPU has them (the same bits).
///
/// # Panics
/// If the slices' lengths do not fit (see [`optim_step`](super::optim_step)).
// A kernel's argument list (the CUDA version takes the same); a struct would only rename it.
#[allow(clippy::too_many_arguments)]
pub fn step_mixed<T: Float>(
    h: &Optimizer,
    t: u64,
    master: &mut [f32],
    params: Option<&mut [T]>,
    grads: &[T],
    s1: &mut [f32],
    s2: &mut [f32],
    grad_scale: f32,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the function needs AVX2 and F16C and nothing else, and this CPU has them
        // (checked).
        return unsafe { step_mixed_avx2(h, t, master, params, grads, s1, s2, grad_scale) };
    }
    step_mixed_any::<T, false>(h, t, master, params, grads, s1, s2, grad_scale)
}

/// [`step_mixed_any`] compiled for AVX2's eight-lane vectors (the baseline x86-64 has four),
/// with f16 converted by F16C inside the loop: the same IEEE operations on each element in the
/// same order (Rust never fuses a multiply and an add on its own), so the same bits, in fewer
/// instructions.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn step_mixed_avx2<T: Float>(
    h: &Optimizer,
    t: u64,
    master: &mut [f32],
    params: Option<&mut [T]>,
    grads: &[T],
    s1: &mut [f32],
    s2: &mut [f32],
    grad_scale: f32,
) {
    step_mixed_any::<T, true>(h, t, master, params, grads, s1, s2, grad_scale)
}

/// Elements of 16-bit gradients the step widens at a time (4 KiB of f32: with the block's
/// parameters, well inside L1 beside the streams of master and moments).
const STEP_BLOCK: usize = 1024;

/// [`step_mixed`] for any CPU, inlined into each version the dispatch picks from.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn step_mixed_any<T: Float, const F16C: bool>(
    h: &Optimizer,
    t: u64,
    master: &mut [f32],
    params: Option<&mut [T]>,
    grads: &[T],
    s1: &mut [f32],
    s2: &mut [f32],
    grad_scale: f32,
) {
    let n = master.len();
    assert_eq!(grads.len(), n, "step_mixed: gradient length differs");
    // A state the rule keeps is as long as the master; one it does not keep stays empty.
    let (k1, k2) = (!s1.is_empty(), !s2.is_empty());
    let mut params = params;
    if let Some(p) = &params {
        assert_eq!(p.len(), n, "step_mixed: parameter length differs");
    }
    // Written out, not through `widened` and a closure: everything here is inlined into each
    // dispatched version, so all of it gets that version's vectors.
    let (k, keeps) = (h.step_scalars(t), h.states().len());
    if T::IS_F32 && params.is_none() {
        let g: &[f32] = bytemuck::cast_slice(grads);
        return optim_step_inline(&k, keeps, master, g, s1, s2, grad_scale);
    }
    // Block by block; each block's parameters are rounded from its master while the block is
    // in cache: one pass over memory, not a second over the whole master.
    let mut buf = [0f32; STEP_BLOCK];
    for (i, block) in grads.chunks(STEP_BLOCK).enumerate() {
        let r = i * STEP_BLOCK..i * STEP_BLOCK + block.len();
        let g = &mut buf[..block.len()];
        widen_block::<T, F16C>(block, g);
        let r1 = if k1 { r.clone() } else { 0..0 };
        let r2 = if k2 { r.clone() } else { 0..0 };
        optim_step_inline(
            &k,
            keeps,
            &mut master[r.clone()],
            g,
            &mut s1[r1],
            &mut s2[r2],
            grad_scale,
        );
        if let Some(p) = params.as_deref_mut() {
            narrow_block::<T, F16C>(&master[r.clone()], &mut p[r]);
        }
    }
}

/// [`optim_step`](super::optim_step) on `threads` threads at once, each on its own run of
/// elements (the update is element-wise, so the bits are those of one thread):
/// [`step_mixed_threads`] on `f32` parameters that are their own master.
///
/// # Panics
/// As [`optim_step`](super::optim_step).
#[allow(clippy::too_many_arguments)]
pub fn optim_step_threads(
    h: &Optimizer,
    t: u64,
    params: &mut [f32],
    grads: &[f32],
    s1: &mut [f32],
    s2: &mut [f32],
    grad_scale: f32,
    threads: usize,
) {
    step_mixed_threads::<f32>(h, t, params, None, grads, s1, s2, grad_scale, threads)
}

/// [`step_mixed`] on `threads` threads at once, each on its own run of elements (element-wise,
/// so the bits are those of one thread): the CPU optimizer of ZeRO-Offload, where one core's loop
/// leaves most of the memory bandwidth idle. Runs of fewer than 16384 elements stay on the
/// calling thread.
///
/// # Panics
/// As [`step_mixed`].
#[allow(clippy::too_many_arguments)]
pub fn step_mixed_threads<T: Float>(
    h: &Optimizer,
    t: u64,
    master: &mut [f32],
    params: Option<&mut [T]>,
    grads: &[T],
    s1: &mut [f32],
    s2: &mut [f32],
    grad_scale: f32,
    threads: usize,
) {
    const MIN_RUN: usize = 16384;
    let n = master.len();
    assert_eq!(grads.len(), n, "step_mixed: gradient length differs");
    let runs = threads.clamp(1, n.div_ceil(MIN_RUN).max(1));
    if runs == 1 {
        return step_mixed(h, t, master, params, grads, s1, s2, grad_scale);
    }
    // Whole cache lines per run (16 f32), so no two threads write one line of the master.
    let run = n.div_ceil(runs).div_ceil(16) * 16;
    let (k1, k2) = (!s1.is_empty(), !s2.is_empty());
    std::thread::scope(|sc| {
        let (mut m, mut p, mut g, mut a, mut b) = (master, params, grads, s1, s2);
        while !m.is_empty() {
            let len = run.min(m.len());
            let (m0, m1) = std::mem::take(&mut m).split_at_mut(len);
            let (p0, p1) = match p.take() {
                Some(p) => {
                    let (x, y) = p.split_at_mut(len);
                    (Some(x), Some(y))
                }
                None => (None, None),
            };
            let (g0, g1) = g.split_at(len);
            let (a0, a1) = std::mem::take(&mut a).split_at_mut(if k1 { len } else { 0 });
            let (b0, b1) = std::mem::take(&mut b).split_at_mut(if k2 { len } else { 0 });
            (m, p, g, a, b) = (m1, p1, g1, a1, b1);
            sc.spawn(move || step_mixed(h, t, m0, p0, g0, a0, b0, grad_scale));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::optim_step;

    /// The version the dispatch picks on this CPU (AVX2's on x86-64 machines that have it)
    /// against the baseline one, bit for bit, for every rule and dtype, with and without the
    /// rounded parameters.
    #[test]
    fn every_vector_width_computes_the_same_bits() {
        fn check<T: Float + PartialEq + std::fmt::Debug>() {
            for h in Optimizer::each_rule() {
                let n = 4099;
                let keeps = h.states().len();
                let wide: Vec<f32> = (0..n).map(|i| (i as f32 * 0.29).sin() * 3.0).collect();
                let mut g = vec![T::default(); n];
                T::narrow(&wide, &mut g);
                let mut master: Vec<f32> = (0..n).map(|i| (i as f32 * 0.011).cos()).collect();
                let state = |k: usize| vec![0.02f32; if keeps > k { n } else { 0 }];
                let (mut m, mut v, mut p) = (state(0), state(1), vec![T::default(); n]);
                let (mut master2, mut m2, mut v2, mut p2) =
                    (master.clone(), m.clone(), v.clone(), p.clone());
                for t in 1..=3 {
                    let (pa, pb) = match T::IS_F32 && t == 2 {
                        true => (None, None),
                        false => (Some(&mut p[..]), Some(&mut p2[..])),
                    };
                    step_mixed(&h, t, &mut master, pa, &g, &mut m, &mut v, 0.25);
                    step_mixed_any::<T, false>(&h, t, &mut master2, pb, &g, &mut m2, &mut v2, 0.25);
                }
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&master), bits(&master2), "{h:?}");
                assert_eq!((bits(&m), bits(&v)), (bits(&m2), bits(&v2)), "{h:?}");
                assert_eq!(p, p2, "{h:?}");
            }
        }
        check::<f32>();
        check::<bf16>();
        check::<f16>();
    }

    /// The step's own 16-bit conversions against `half`'s, bit for bit: every bf16 and f16
    /// widened, and f32s rounded — each 16-bit pattern's neighbourhood (exact, just below, at
    /// and above the halfway point, the last), the specials (±0, ±inf, quiet and signalling
    /// NaNs, subnormals) and a million pseudo-random patterns.
    #[test]
    fn the_steps_conversions_are_halfs_bit_for_bit() {
        let mut f: Vec<f32> = Vec::new();
        for hi in 0..=0xffffu32 {
            for lo in [0u32, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1000, 0x0fff] {
                f.push(f32::from_bits(hi << 16 | lo));
            }
        }
        let mut x = 0x9e37_79b9u32;
        for _ in 0..1_000_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            f.push(f32::from_bits(x));
        }
        let all16: Vec<u16> = (0..=0xffffu16).collect();
        // bf16.
        let mut ours = vec![bf16::ZERO; f.len()];
        bf16_narrow(&f, &mut ours);
        for (v, o) in f.iter().zip(&ours) {
            assert_eq!(
                o.to_bits(),
                bf16::from_f32(*v).to_bits(),
                "{:#010x}",
                v.to_bits()
            );
        }
        let b: Vec<bf16> = all16.iter().map(|&u| bf16::from_bits(u)).collect();
        let mut wide = vec![0f32; b.len()];
        bf16_widen(&b, &mut wide);
        for (o, w) in b.iter().zip(&wide) {
            assert_eq!(w.to_bits(), o.to_f32().to_bits(), "{:#06x}", o.to_bits());
        }
        // f16 through F16C, where this CPU has it.
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            #[target_feature(enable = "avx2,f16c")]
            fn both(f: &[f32], narrow: &mut [f16], h: &[f16], wide: &mut [f32]) {
                // SAFETY: compiled with AVX2 and F16C, called on a CPU with both (checked).
                unsafe {
                    f16_narrow_f16c(f, narrow);
                    f16_widen_f16c(h, wide);
                }
            }
            let h: Vec<f16> = all16.iter().map(|&u| f16::from_bits(u)).collect();
            let mut narrow = vec![f16::ZERO; f.len()];
            // SAFETY: the CPU has AVX2 and F16C (checked above).
            unsafe { both(&f, &mut narrow, &h, &mut wide) };
            for (v, o) in f.iter().zip(&narrow) {
                assert_eq!(
                    o.to_bits(),
                    f16::from_f32(*v).to_bits(),
                    "{:#010x}",
                    v.to_bits()
                );
            }
            for (o, w) in h.iter().zip(&wide) {
                assert_eq!(w.to_bits(), o.to_f32().to_bits(), "{:#06x}", o.to_bits());
            }
        }
    }

    #[test]
    fn threads_compute_the_bits_of_one_for_every_rule() {
        for h in Optimizer::each_rule() {
            let n = 100_003;
            let keeps = h.states().len();
            let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.013).sin()).collect();
            let mut p: Vec<f32> = (0..n).map(|i| (i as f32 * 0.007).cos()).collect();
            let state = |k: usize| vec![0.01f32; if keeps > k { n } else { 0 }];
            let (mut m, mut v) = (state(0), state(1));
            let (mut p4, mut m4, mut v4) = (p.clone(), m.clone(), v.clone());
            for t in 1..=3 {
                optim_step(&h, t, &mut p, &g, &mut m, &mut v, 0.5);
                optim_step_threads(&h, t, &mut p4, &g, &mut m4, &mut v4, 0.5, 4);
            }
            assert_eq!((&p, &m, &v), (&p4, &m4, &v4), "{h:?}");
        }
    }

    #[test]
    fn the_threaded_step_computes_one_threads_bits() {
        let n = 100_003;
        let h = Optimizer::adamw(1e-3);
        let g: Vec<half::bf16> = (0..n)
            .map(|i| half::bf16::from_f32((i as f32 * 0.37).sin()))
            .collect();
        let start: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let run = |threads| {
            let (mut m, mut s1, mut s2) = (start.clone(), vec![0.1f32; n], vec![0.2f32; n]);
            let mut p = vec![half::bf16::ZERO; n];
            for t in 1..=3 {
                step_mixed_threads(
                    &h,
                    t,
                    &mut m,
                    Some(&mut p),
                    &g,
                    &mut s1,
                    &mut s2,
                    0.5,
                    threads,
                );
            }
            (m, p, s1, s2)
        };
        let one = run(1);
        assert_eq!(run(4), one);
        assert_eq!(run(7), one);
        assert_ne!(one.0, start);
    }

    #[test]
    fn casts_round_to_nearest_and_back() {
        let x: Vec<f32> = (0..1000)
            .map(|i| (i as f32 * 0.731).sin() * 100.0)
            .collect();
        let mut h = vec![bf16::ZERO; x.len()];
        cast(&x, &mut h);
        for (a, b) in x.iter().zip(&h) {
            assert_eq!(*b, bf16::from_f32(*a));
        }
        let mut back = vec![0f32; x.len()];
        cast(&h, &mut back);
        for (a, b) in h.iter().zip(&back) {
            assert_eq!(a.to_f32(), *b);
        }
        let mut f = vec![f16::ZERO; x.len()];
        cast(&h, &mut f);
        assert_eq!(f[7], f16::from_f32(h[7].to_f32()));
    }

    #[test]
    fn norm_scale_and_finite_check() {
        let x: Vec<f16> = (0..700).map(|i| f16::from_f32(i as f32 * 0.01)).collect();
        let want: f64 = x.iter().map(|v| (v.to_f32() as f64 * 0.5).powi(2)).sum();
        assert!((sq_norm(&x, 0.5) - want).abs() < 1e-9 * want);
        assert!(all_finite(&x));
        let mut y = x.clone();
        y[513] = f16::INFINITY;
        assert!(!all_finite(&y));
        assert!(sq_norm(&y, 1.0).is_infinite());
        y[513] = f16::NAN;
        assert!(!all_finite(&y));
        let mut z = x.clone();
        scale(&mut z, 2.0);
        assert_eq!(z[300], f16::from_f32(x[300].to_f32() * 2.0));
    }

    #[test]
    fn a_mixed_step_equals_the_fp32_step_on_widened_gradients() {
        let h = Optimizer::default();
        let n = 600;
        let g16: Vec<bf16> = (0..n).map(|i| bf16::from_f32((i as f32).cos())).collect();
        let g32: Vec<f32> = g16.iter().map(|g| g.to_f32()).collect();
        let mut master: Vec<f32> = (0..n).map(|i| (i as f32 * 0.1).sin()).collect();
        let mut master2 = master.clone();
        let (mut m, mut v, mut m2, mut v2) =
            (vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        let mut p = vec![bf16::ZERO; n];
        step_mixed(&h, 1, &mut master, Some(&mut p), &g16, &mut m, &mut v, 0.25);
        optim_step(&h, 1, &mut master2, &g32, &mut m2, &mut v2, 0.25);
        assert_eq!(master, master2);
        assert_eq!(m, m2);
        for (a, b) in p.iter().zip(&master) {
            assert_eq!(*a, bf16::from_f32(*b));
        }
    }
}
