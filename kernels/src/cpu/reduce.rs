use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::{DType, Element, KernelError, ReduceOp};

/// Elements widened per block on the 16-bit paths (two 1 KiB `f32` stack buffers).
pub const HALF_BLOCK: usize = 256;

/// `dst[i] = dst[i] ⊕ src[i]` on byte slices tagged with `dtype`. `Avg` combines as `Sum`.
pub fn reduce_into(
    dtype: DType,
    op: ReduceOp,
    dst: &mut [u8],
    src: &[u8],
) -> Result<(), KernelError> {
    same_len("reduce_into", dst.len(), src.len())?;
    macro_rules! go {
        ($t:ty) => {{
            let d: &mut [$t] = cast_mut("reduce_into", dtype, dst)?;
            let s: &[$t] = cast("reduce_into", dtype, src)?;
            Kernel::reduce_into(op, d, s);
        }};
    }
    dispatch!(dtype, go);
    Ok(())
}

/// `out[i] = a[i] ⊕ b[i]` on byte slices tagged with `dtype`. `Avg` combines as `Sum`.
pub fn reduce_to(
    dtype: DType,
    op: ReduceOp,
    out: &mut [u8],
    a: &[u8],
    b: &[u8],
) -> Result<(), KernelError> {
    same_len("reduce_to", out.len(), a.len())?;
    same_len("reduce_to", out.len(), b.len())?;
    macro_rules! go {
        ($t:ty) => {{
            let o: &mut [$t] = cast_mut("reduce_to", dtype, out)?;
            let x: &[$t] = cast("reduce_to", dtype, a)?;
            let y: &[$t] = cast("reduce_to", dtype, b)?;
            Kernel::reduce_to(op, o, x, y);
        }};
    }
    dispatch!(dtype, go);
    Ok(())
}

/// Finish an `Avg`: `buf[i] = buf[i] / n` (integers truncate toward zero).
pub fn divide(dtype: DType, buf: &mut [u8], n: usize) -> Result<(), KernelError> {
    macro_rules! go {
        ($t:ty) => {{
            let b: &mut [$t] = cast_mut("divide", dtype, buf)?;
            Kernel::divide(b, n);
        }};
    }
    dispatch!(dtype, go);
    Ok(())
}

/// Typed form of [`reduce_into`].
pub fn reduce_into_typed<T: Element>(
    op: ReduceOp,
    dst: &mut [T],
    src: &[T],
) -> Result<(), KernelError> {
    reduce_into(
        T::DTYPE,
        op,
        bytemuck::cast_slice_mut(dst),
        bytemuck::cast_slice(src),
    )
}

/// Typed form of [`reduce_to`].
pub fn reduce_to_typed<T: Element>(
    op: ReduceOp,
    out: &mut [T],
    a: &[T],
    b: &[T],
) -> Result<(), KernelError> {
    reduce_to(
        T::DTYPE,
        op,
        bytemuck::cast_slice_mut(out),
        bytemuck::cast_slice(a),
        bytemuck::cast_slice(b),
    )
}

macro_rules! dispatch {
    ($dtype:expr, $go:ident) => {
        match $dtype {
            DType::F32 => $go!(f32),
            DType::F64 => $go!(f64),
            DType::F16 => $go!(f16),
            DType::BF16 => $go!(bf16),
            DType::I32 => $go!(i32),
            DType::I64 => $go!(i64),
            DType::U8 => $go!(u8),
        }
    };
}
use dispatch;

fn same_len(kernel: &'static str, left: usize, right: usize) -> Result<(), KernelError> {
    if left == right {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch {
            kernel,
            left,
            right,
        })
    }
}

fn layout_err(kernel: &'static str, dtype: DType, b: &[u8]) -> KernelError {
    KernelError::BadLayout {
        kernel,
        dtype,
        bytes: b.len(),
        addr: b.as_ptr() as usize,
    }
}

fn cast<'a, T: bytemuck::Pod>(
    kernel: &'static str,
    dtype: DType,
    b: &'a [u8],
) -> Result<&'a [T], KernelError> {
    bytemuck::try_cast_slice(b).map_err(|_| layout_err(kernel, dtype, b))
}

fn cast_mut<'a, T: bytemuck::Pod>(
    kernel: &'static str,
    dtype: DType,
    b: &'a mut [u8],
) -> Result<&'a mut [T], KernelError> {
    if bytemuck::try_cast_slice::<u8, T>(b).is_err() {
        return Err(layout_err(kernel, dtype, b));
    }
    Ok(bytemuck::cast_slice_mut(b))
}

/// One implementation per element type. The operator is matched once, outside the loop.
trait Kernel: Copy {
    fn reduce_into(op: ReduceOp, dst: &mut [Self], src: &[Self]);
    fn reduce_to(op: ReduceOp, out: &mut [Self], a: &[Self], b: &[Self]);
    fn divide(buf: &mut [Self], n: usize);
}

#[inline(always)]
fn zip2<T: Copy>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f(*d, *s);
    }
}

#[inline(always)]
fn zip3<T: Copy>(out: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = f(*x, *y);
    }
}

// `if y < x` rather than `f32::min`: it compiles to minps/maxps and vectorizes.
macro_rules! float_kernel {
    ($t:ty) => {
        impl Kernel for $t {
            fn reduce_into(op: ReduceOp, dst: &mut [$t], src: &[$t]) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => zip2(dst, src, |x, y| x + y),
                    ReduceOp::Prod => zip2(dst, src, |x, y| x * y),
                    ReduceOp::Min => zip2(dst, src, |x, y| if y < x { y } else { x }),
                    ReduceOp::Max => zip2(dst, src, |x, y| if y > x { y } else { x }),
                }
            }
            fn reduce_to(op: ReduceOp, out: &mut [$t], a: &[$t], b: &[$t]) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => zip3(out, a, b, |x, y| x + y),
                    ReduceOp::Prod => zip3(out, a, b, |x, y| x * y),
                    ReduceOp::Min => zip3(out, a, b, |x, y| if y < x { y } else { x }),
                    ReduceOp::Max => zip3(out, a, b, |x, y| if y > x { y } else { x }),
                }
            }
            fn divide(buf: &mut [$t], n: usize) {
                let n = n as $t;
                buf.iter_mut().for_each(|x| *x /= n);
            }
        }
    };
}
float_kernel!(f32);
float_kernel!(f64);

macro_rules! int_kernel {
    ($t:ty) => {
        impl Kernel for $t {
            fn reduce_into(op: ReduceOp, dst: &mut [$t], src: &[$t]) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => zip2(dst, src, <$t>::wrapping_add),
                    ReduceOp::Prod => zip2(dst, src, <$t>::wrapping_mul),
                    ReduceOp::Min => zip2(dst, src, |x, y| x.min(y)),
                    ReduceOp::Max => zip2(dst, src, |x, y| x.max(y)),
                }
            }
            fn reduce_to(op: ReduceOp, out: &mut [$t], a: &[$t], b: &[$t]) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => zip3(out, a, b, <$t>::wrapping_add),
                    ReduceOp::Prod => zip3(out, a, b, <$t>::wrapping_mul),
                    ReduceOp::Min => zip3(out, a, b, |x, y| x.min(y)),
                    ReduceOp::Max => zip3(out, a, b, |x, y| x.max(y)),
                }
            }
            fn divide(buf: &mut [$t], n: usize) {
                // n is a world size (≤ 2^31), so it fits every signed type we divide; for u8 a
                // world larger than 255 makes every quotient 0, which is what the division means.
                match <$t>::try_from(n) {
                    Ok(n) => buf.iter_mut().for_each(|x| *x /= n),
                    Err(_) => buf.iter_mut().for_each(|x| *x = 0),
                }
            }
        }
    };
}
int_kernel!(i32);
int_kernel!(i64);
int_kernel!(u8);

/// 16-bit floats: widen a block to f32, combine there, round back once per pairwise combine.
macro_rules! half_kernel {
    ($t:ty) => {
        impl Kernel for $t {
            fn reduce_into(op: ReduceOp, dst: &mut [$t], src: &[$t]) {
                let mut x = [0f32; HALF_BLOCK];
                let mut y = [0f32; HALF_BLOCK];
                for (d, s) in dst.chunks_mut(HALF_BLOCK).zip(src.chunks(HALF_BLOCK)) {
                    let (x, y) = (&mut x[..d.len()], &mut y[..d.len()]);
                    d.convert_to_f32_slice(x);
                    s.convert_to_f32_slice(y);
                    <f32 as Kernel>::reduce_into(op, x, y);
                    d.convert_from_f32_slice(x);
                }
            }
            fn reduce_to(op: ReduceOp, out: &mut [$t], a: &[$t], b: &[$t]) {
                let mut x = [0f32; HALF_BLOCK];
                let mut y = [0f32; HALF_BLOCK];
                let blocks = out
                    .chunks_mut(HALF_BLOCK)
                    .zip(a.chunks(HALF_BLOCK))
                    .zip(b.chunks(HALF_BLOCK));
                for ((o, a), b) in blocks {
                    let (x, y) = (&mut x[..o.len()], &mut y[..o.len()]);
                    a.convert_to_f32_slice(x);
                    b.convert_to_f32_slice(y);
                    <f32 as Kernel>::reduce_into(op, x, y);
                    o.convert_from_f32_slice(x);
                }
            }
            fn divide(buf: &mut [$t], n: usize) {
                let mut x = [0f32; HALF_BLOCK];
                for d in buf.chunks_mut(HALF_BLOCK) {
                    let x = &mut x[..d.len()];
                    d.convert_to_f32_slice(x);
                    <f32 as Kernel>::divide(x, n);
                    d.convert_from_f32_slice(x);
                }
            }
        }
    };
}
half_kernel!(f16);
half_kernel!(bf16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_and_op_against_scalar_reference() {
        // Small integers: exact in every dtype, including bf16 (8 significant bits).
        let a: Vec<f64> = (0..1000).map(|i| ((i * 7) % 13) as f64 - 3.0).collect();
        let b: Vec<f64> = (0..1000).map(|i| ((i * 5) % 11) as f64 - 2.0).collect();
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                let unsigned = dtype == DType::U8;
                let fix = |v: f64| if unsigned { v.abs() } else { v };
                let a: Vec<f64> = a.iter().map(|&v| fix(v)).collect();
                let b: Vec<f64> = b.iter().map(|&v| fix(v)).collect();
                let want: Vec<f64> = a
                    .iter()
                    .zip(&b)
                    .map(|(&x, &y)| match op {
                        ReduceOp::Sum | ReduceOp::Avg => x + y,
                        ReduceOp::Prod => x * y,
                        ReduceOp::Min => x.min(y),
                        ReduceOp::Max => x.max(y),
                    })
                    .collect();
                let (ab, bb) = (encode(dtype, &a), encode(dtype, &b));
                let mut out = vec![0u8; ab.len()];
                reduce_to(dtype, op, &mut out, &ab, &bb).unwrap();
                assert_eq!(decode(dtype, &out), want, "{dtype} {op} reduce_to");
                let mut dst = ab.clone();
                reduce_into(dtype, op, &mut dst, &bb).unwrap();
                assert_eq!(decode(dtype, &dst), want, "{dtype} {op} reduce_into");
            }
        }
    }

    #[test]
    fn divide_truncates_integers_and_rounds_floats_once() {
        let mut v = encode(DType::I32, &[7.0, -7.0, 9.0]);
        divide(DType::I32, &mut v, 2).unwrap();
        assert_eq!(decode(DType::I32, &v), vec![3.0, -3.0, 4.0]);
        let mut h = encode(DType::F16, &[3.0, 1.0]);
        divide(DType::F16, &mut h, 3).unwrap();
        assert_eq!(
            decode(DType::F16, &h),
            vec![1.0, f16::from_f32(1.0 / 3.0).to_f64()]
        );
    }

    #[test]
    fn length_and_layout_errors_name_the_problem() {
        let mut d = vec![0u8; 8];
        let e = reduce_into(DType::F32, ReduceOp::Sum, &mut d, &[0u8; 4]).unwrap_err();
        assert!(e.to_string().contains("8 vs 4"), "{e}");
        let mut odd = vec![0u8; 6];
        let e = reduce_into(DType::F32, ReduceOp::Sum, &mut odd, &[0u8; 6]).unwrap_err();
        assert!(
            matches!(
                e,
                KernelError::BadLayout {
                    dtype: DType::F32,
                    bytes: 6,
                    ..
                }
            ),
            "{e}"
        );
    }

    pub(crate) fn encode(dtype: DType, v: &[f64]) -> Vec<u8> {
        let mut out = Vec::new();
        for &x in v {
            match dtype {
                DType::F32 => out.extend_from_slice(&(x as f32).to_ne_bytes()),
                DType::F64 => out.extend_from_slice(&x.to_ne_bytes()),
                DType::F16 => out.extend_from_slice(&f16::from_f64(x).to_ne_bytes()),
                DType::BF16 => out.extend_from_slice(&bf16::from_f64(x).to_ne_bytes()),
                DType::I32 => out.extend_from_slice(&(x as i32).to_ne_bytes()),
                DType::I64 => out.extend_from_slice(&(x as i64).to_ne_bytes()),
                DType::U8 => out.push(x as u8),
            }
        }
        out
    }

    pub(crate) fn decode(dtype: DType, b: &[u8]) -> Vec<f64> {
        b.chunks(dtype.size())
            .map(|c| match dtype {
                DType::F32 => f32::from_ne_bytes(c.try_into().unwrap()) as f64,
                DType::F64 => f64::from_ne_bytes(c.try_into().unwrap()),
                DType::F16 => f16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
                DType::BF16 => bf16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
                DType::I32 => i32::from_ne_bytes(c.try_into().unwrap()) as f64,
                DType::I64 => i64::from_ne_bytes(c.try_into().unwrap()) as f64,
                DType::U8 => c[0] as f64,
            })
            .collect()
    }
}
