//! The device kernels' source run on the host: `tests/emu/launch.cpp` compiles
//! `src/cuda/kernels.cu` with the host C++ compiler (F16C for the f16 conversions the device does
//! with `cvt.rn`) and runs every thread of a launch one after another (the squared norm's, whose
//! threads cooperate, as host threads of a block at a barrier), and every kernel is checked here
//! against the CPU kernels, bit for bit (the norm, summed in another order, to f64 rounding), on
//! several grid shapes (one thread; strides of 15 and 128), aligned and misaligned ranges, with
//! poisoned bytes around every output. So a kernel's index arithmetic — the 16-byte vector path,
//! its tails, the split of a `copy_pair` launch between its two copies, a block's tree — is
//! checked on every CI run, not only when a GPU is lent (`ringzero gpu-check` runs the same
//! kernels on the device, where speed and the device's own arithmetic are checked). Without a
//! C++ compiler the tests print SKIPPED and why.

#![cfg(feature = "cuda")]

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use half::{bf16, f16};
use ringzero_kernels::cpu::{self, Float, Optimizer};
use ringzero_kernels::device::cuda::cu_type;
use ringzero_kernels::{DType, ReduceOp};

/// Grid shapes (blocks, threads per block): a grid-stride of 1, 15 and 128.
const GRIDS: [(u32, u32); 3] = [(1, 1), (3, 5), (2, 64)];
/// Bytes written around every output, which must stay as they were.
const GUARD: usize = 32;
const POISON: u8 = 0xA5;

type CopyPair =
    unsafe extern "C" fn(c_uint, c_uint, *mut u8, *const u8, u64, *mut u8, *mut u8, *const u8, u64);
type Copy2 = unsafe extern "C" fn(c_uint, c_uint, *mut u8, *mut u8, *const u8, u64);
type Combine2 = unsafe extern "C" fn(
    *const c_char,
    c_uint,
    c_uint,
    *mut c_void,
    *mut c_void,
    *const c_void,
    *const c_void,
    u64,
) -> c_int;
type Reduce =
    unsafe extern "C" fn(*const c_char, c_uint, c_uint, *mut c_void, *const c_void, u64) -> c_int;
type Gather = unsafe extern "C" fn(
    *const c_char,
    c_uint,
    c_uint,
    *const u64,
    u32,
    *const u64,
    u32,
    u64,
    c_int,
) -> c_int;
type Cast =
    unsafe extern "C" fn(*const c_char, c_uint, c_uint, *const c_void, *mut c_void, u64) -> c_int;
type Scale = unsafe extern "C" fn(*const c_char, c_uint, c_uint, *mut c_void, f32, u64) -> c_int;
type Nonfinite =
    unsafe extern "C" fn(*const c_char, c_uint, c_uint, *const c_void, u64, *mut u32) -> c_int;
type OptimStep = unsafe extern "C" fn(
    *const c_char,
    c_uint,
    c_uint,
    *mut f32,
    *mut c_void,
    *const c_void,
    *mut f32,
    *mut f32,
    u64,
    c_uint,
    *const f32,
) -> c_int;
type SqNorm =
    unsafe extern "C" fn(*const c_char, c_uint, c_uint, *const c_void, f32, u64, *mut f64) -> c_int;
type Divide = unsafe extern "C" fn(*const c_char, c_uint, c_uint, *mut c_void, u64, c_int) -> c_int;

/// The compiled kernels, or why there are none.
fn emulator() -> Result<&'static libloading::Library, String> {
    static LIB: OnceLock<Result<libloading::Library, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/emu/launch.cpp");
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("ringzero-kernels-emu-{}.so", std::process::id()));
        let run = Command::new(&cxx)
            .args([
                "-O1",
                "-std=c++17",
                "-mf16c",
                "-ffp-contract=off",
                "-pthread",
            ])
            .args(["-shared", "-fPIC", "-Wno-unknown-pragmas", "-o"])
            .arg(&out)
            .arg(&src)
            .output()
            .map_err(|e| format!("no C++ compiler ({cxx}: {e})"))?;
        if !run.status.success() {
            // A compiler that is there but fails on the kernels' source is a failure, not a skip.
            panic!(
                "{cxx} failed on {}:\n{}",
                src.display(),
                String::from_utf8_lossy(&run.stderr)
            );
        }
        // SAFETY: the library is the harness just built; its initialisers only zero statics.
        unsafe { libloading::Library::new(&out) }.map_err(|e| format!("loading {out:?}: {e}"))
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The emulator, or `None` after printing why `test` is skipped.
fn lib_for(test: &str) -> Option<&'static libloading::Library> {
    match emulator() {
        Ok(l) => Some(l),
        Err(why) => {
            eprintln!("SKIPPED {test}: {why}");
            None
        }
    }
}

fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> T {
    // SAFETY: every `T` used here is the C signature `launch.cpp` gives the symbol.
    *unsafe { lib.get::<T>(name.as_bytes()) }.unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// A byte buffer whose data starts `skew` bytes past a 16-byte boundary, with poisoned guard
/// bytes on both sides.
struct Buf {
    mem: Vec<u8>,
    at: usize,
    len: usize,
}

impl Buf {
    fn new(len: usize, skew: usize) -> Buf {
        let mem = vec![POISON; len + 2 * GUARD + 32];
        let base = mem.as_ptr() as usize + GUARD;
        let at = GUARD + (16 - base % 16) % 16 + skew;
        Buf { mem, at, len }
    }
    fn with(data: &[u8], skew: usize) -> Buf {
        let mut b = Buf::new(data.len(), skew);
        b.bytes_mut().copy_from_slice(data);
        b
    }
    fn bytes(&self) -> &[u8] {
        &self.mem[self.at..self.at + self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.mem[self.at..self.at + self.len]
    }
    fn ptr(&mut self) -> *mut u8 {
        self.bytes_mut().as_mut_ptr()
    }
    /// Nothing written outside the data.
    fn guards_intact(&self) -> bool {
        self.mem[..self.at]
            .iter()
            .chain(&self.mem[self.at + self.len..])
            .all(|&b| b == POISON)
    }
}

/// Deterministic test bytes (splitmix64).
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)) as u8
        })
        .collect()
}

/// `n` values of `dtype` as bytes: floats in [-2, 2) in steps of 1/64 (finite sums and products
/// of eight), integers anywhere in their range (wrapping is part of what is checked).
fn values(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
    let raw = noise(n * 2, seed);
    let small =
        |i: usize| (u16::from_le_bytes([raw[2 * i], raw[2 * i + 1]]) % 256) as f64 / 64.0 - 2.0;
    match dtype {
        DType::F32 => (0..n)
            .flat_map(|i| (small(i) as f32).to_le_bytes())
            .collect(),
        DType::F64 => (0..n).flat_map(|i| small(i).to_le_bytes()).collect(),
        DType::F16 => (0..n)
            .flat_map(|i| f16::from_f64(small(i)).to_le_bytes())
            .collect(),
        DType::BF16 => (0..n)
            .flat_map(|i| bf16::from_f64(small(i)).to_le_bytes())
            .collect(),
        DType::I32 | DType::I64 | DType::U8 => noise(n * dtype.size(), seed ^ 0x5EED),
    }
}

/// `got == want`, or a panic naming the first element that differs (not a dump of both).
fn same(got: &[u8], want: &[u8], what: impl FnOnce() -> String) {
    if got == want {
        return;
    }
    let i = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    let at = |b: &[u8]| {
        b.get(i.saturating_sub(4)..(i + 8).min(b.len()))
            .map(<[u8]>::to_vec)
    };
    panic!(
        "{}: {} bytes against {}, first difference at byte {i}: got {:?}, want {:?} (from byte {})",
        what(),
        got.len(),
        want.len(),
        at(got),
        at(want),
        i.saturating_sub(4)
    );
}

fn op_name(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "sum",
        ReduceOp::Prod => "prod",
        ReduceOp::Min => "min",
        ReduceOp::Max => "max",
        ReduceOp::Avg => unreachable!("avg is sum then divide"),
    }
}

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max];
/// Elements per check: one, a few, one short of a 1024-element block, and over 4096 with a tail.
const COUNTS: [usize; 4] = [1, 3, 1023, 4099];

#[test]
fn copy_pair_and_copy2_write_exactly_their_ranges() {
    let Some(lib) = lib_for("copy_pair_and_copy2_write_exactly_their_ranges") else {
        return;
    };
    let copy_pair: CopyPair = sym(lib, "emu_copy_pair");
    let copy2: Copy2 = sym(lib, "emu_copy2");
    let sizes = [0usize, 1, 15, 16, 17, 4096 + 3, 70_000];
    let mut case = 0u64;
    for &(grid, block) in &GRIDS {
        for &a_len in &sizes {
            for &b_len in &sizes {
                // Aligned, then each side one byte in (the byte path).
                for (a_skew, b_skew) in [(0, 0), (1, 0), (0, 3)] {
                    for keep in [false, true] {
                        case += 1;
                        let (a_src, b_src) = (noise(a_len, case), noise(b_len, !case));
                        let mut a_in = Buf::with(&a_src, a_skew);
                        let mut b_in = Buf::with(&b_src, b_skew);
                        let mut a = Buf::new(a_len, a_skew);
                        let mut b = Buf::new(b_len, b_skew);
                        let mut also = Buf::new(b_len, b_skew);
                        let also_ptr = if keep {
                            also.ptr()
                        } else {
                            std::ptr::null_mut()
                        };
                        // SAFETY: every pointer spans its length; the outputs are distinct.
                        unsafe {
                            copy_pair(
                                grid,
                                block,
                                a.ptr(),
                                a_in.ptr(),
                                a_len as u64,
                                b.ptr(),
                                also_ptr,
                                b_in.ptr(),
                                b_len as u64,
                            )
                        };
                        let what = format!(
                            "copy_pair grid {grid}x{block}, {a_len} bytes (+{a_skew}) and \
                             {b_len} (+{b_skew}), kept: {keep}"
                        );
                        same(a.bytes(), &a_src, || format!("{what}: a"));
                        same(b.bytes(), &b_src, || format!("{what}: b"));
                        assert!(
                            a.guards_intact() && b.guards_intact(),
                            "{what}: wrote outside"
                        );
                        if keep {
                            same(also.bytes(), &b_src, || format!("{what}: b's kept copy"));
                        }
                        assert!(also.guards_intact(), "{what}: b_also written");
                        same(a_in.bytes(), &a_src, || format!("{what}: a source changed"));
                        same(b_in.bytes(), &b_src, || format!("{what}: b source changed"));
                    }
                }
            }
            // copy2 on the same sizes.
            for skew in [0, 5] {
                let src = noise(a_len, a_len as u64 + skew as u64);
                let mut s = Buf::with(&src, skew);
                let (mut d, mut o) = (Buf::new(a_len, skew), Buf::new(a_len, skew));
                // SAFETY: as above.
                unsafe { copy2(grid, block, d.ptr(), o.ptr(), s.ptr(), a_len as u64) };
                let what = format!("copy2 grid {grid}x{block}, {a_len} bytes (+{skew})");
                same(d.bytes(), &src, || what.clone());
                same(o.bytes(), &src, || what.clone());
                assert!(
                    d.guards_intact() && o.guards_intact(),
                    "{what}: wrote outside"
                );
            }
        }
    }
}

#[test]
fn combine2_and_reduce_match_the_cpu_kernels_for_every_dtype_and_op() {
    let Some(lib) = lib_for("combine2_and_reduce_match_the_cpu_kernels_for_every_dtype_and_op")
    else {
        return;
    };
    let combine2: Combine2 = sym(lib, "emu_combine2");
    let reduce: Reduce = sym(lib, "emu_reduce");
    for dtype in DType::ALL {
        let es = dtype.size();
        for op in OPS {
            for &n in &COUNTS {
                for &(grid, block) in &GRIDS[1..] {
                    for skew in [0, es] {
                        let seed = (n * 31 + skew) as u64 ^ (op as u64) << 20;
                        let (x, y) = (values(dtype, n, seed), values(dtype, n, seed + 7));
                        let mut want = vec![0u8; n * es];
                        cpu::reduce_to(dtype, op, &mut want, &x, &y).unwrap();
                        let what = format!(
                            "{}_{}, n={n}, grid {grid}x{block}, +{skew} bytes",
                            op_name(op),
                            cu_type(dtype)
                        );

                        let name =
                            CString::new(format!("combine2_{}_{}", op_name(op), cu_type(dtype)))
                                .unwrap();
                        let (mut a, mut b) = (Buf::with(&x, skew), Buf::with(&y, skew));
                        let (mut d, mut o) = (Buf::new(n * es, skew), Buf::new(n * es, skew));
                        // SAFETY: every buffer holds `n` elements; the outputs are distinct.
                        let rc = unsafe {
                            combine2(
                                name.as_ptr(),
                                grid,
                                block,
                                d.ptr().cast(),
                                o.ptr().cast(),
                                a.ptr().cast(),
                                b.ptr().cast(),
                                n as u64,
                            )
                        };
                        assert_eq!(rc, 0, "combine2 {what}: no such kernel");
                        same(d.bytes(), &want, || format!("combine2 {what}"));
                        same(o.bytes(), &want, || format!("combine2 {what}: kept copy"));
                        assert!(
                            d.guards_intact() && o.guards_intact(),
                            "combine2 {what}: outside"
                        );

                        // In place: dst = dst OP src.
                        let name =
                            CString::new(format!("reduce_{}_{}", op_name(op), cu_type(dtype)))
                                .unwrap();
                        let mut dst = Buf::with(&x, skew);
                        // SAFETY: as above.
                        let rc = unsafe {
                            reduce(
                                name.as_ptr(),
                                grid,
                                block,
                                dst.ptr().cast(),
                                b.ptr().cast(),
                                n as u64,
                            )
                        };
                        assert_eq!(rc, 0, "reduce {what}: no such kernel");
                        same(dst.bytes(), &want, || format!("reduce {what}"));
                        assert!(dst.guards_intact(), "reduce {what}: outside");
                    }
                }
            }
        }
    }
}

#[test]
fn gather_and_divide_match_the_cpu_kernels_for_every_dtype_and_op() {
    let Some(lib) = lib_for("gather_and_divide_match_the_cpu_kernels_for_every_dtype_and_op")
    else {
        return;
    };
    let gather: Gather = sym(lib, "emu_gather");
    let divide: Divide = sym(lib, "emu_divide");
    let (grid, block) = GRIDS[1];
    for dtype in DType::ALL {
        let es = dtype.size();
        for op in OPS {
            for &n in &COUNTS[1..] {
                for (nin, nout, average, in_place) in [
                    (1, 1, false, false),
                    (2, 3, true, false),
                    (3, 2, false, true),
                    (8, 8, true, true),
                ] {
                    for skew in [0, es] {
                        let seed = (n * 131 + nin * 7 + skew) as u64 ^ (op as u64) << 24;
                        let ins: Vec<Vec<u8>> = (0..nin)
                            .map(|k| values(dtype, n, seed + k as u64))
                            .collect();
                        let mut want = ins[0].clone();
                        for x in &ins[1..] {
                            cpu::reduce_into(dtype, op, &mut want, x).unwrap();
                        }
                        let ranks = if average { nin } else { 0 };
                        if average {
                            cpu::divide(dtype, &mut want, nin).unwrap();
                        }
                        let mut in_bufs: Vec<Buf> =
                            ins.iter().map(|x| Buf::with(x, skew)).collect();
                        let mut out_bufs: Vec<Buf> = (0..nout - usize::from(in_place))
                            .map(|_| Buf::new(n * es, skew))
                            .collect();
                        let in_ptrs: Vec<u64> =
                            in_bufs.iter_mut().map(|b| b.ptr() as u64).collect();
                        let mut out_ptrs: Vec<u64> =
                            out_bufs.iter_mut().map(|b| b.ptr() as u64).collect();
                        if in_place {
                            // The last input is also an output (the direct step in place).
                            out_ptrs.push(in_ptrs[nin - 1]);
                        }
                        let name =
                            CString::new(format!("gather_{}_{}", op_name(op), cu_type(dtype)))
                                .unwrap();
                        // SAFETY: every pointer spans `n` elements; outputs other than the
                        // in-place one are distinct from each other and from the inputs.
                        let rc = unsafe {
                            gather(
                                name.as_ptr(),
                                grid,
                                block,
                                in_ptrs.as_ptr(),
                                nin as u32,
                                out_ptrs.as_ptr(),
                                nout as u32,
                                n as u64,
                                ranks as c_int,
                            )
                        };
                        let what = format!(
                            "gather_{}_{} n={n}, {nin} in, {nout} out, average {average}, in place \
                             {in_place}, +{skew} bytes",
                            op_name(op),
                            cu_type(dtype)
                        );
                        assert_eq!(rc, 0, "{what}: no such kernel");
                        for (j, o) in out_bufs.iter().enumerate() {
                            same(o.bytes(), &want, || format!("{what}: output {j}"));
                            assert!(o.guards_intact(), "{what}: output {j} outside");
                        }
                        if in_place {
                            same(in_bufs[nin - 1].bytes(), &want, || {
                                format!("{what}: in place")
                            });
                        }
                        for (k, b) in in_bufs.iter().enumerate().take(nin - usize::from(in_place)) {
                            same(b.bytes(), &ins[k], || format!("{what}: input {k} changed"));
                            assert!(b.guards_intact(), "{what}: input {k} outside");
                        }
                    }
                }
            }
        }
        // divide on its own (the end of an average on the ring).
        for &n in &COUNTS {
            let x = values(dtype, n, n as u64 * 3);
            let mut want = x.clone();
            cpu::divide(dtype, &mut want, 3).unwrap();
            let mut b = Buf::with(&x, 0);
            let name = CString::new(format!("divide_{}", cu_type(dtype))).unwrap();
            // SAFETY: the buffer holds `n` elements.
            let rc = unsafe { divide(name.as_ptr(), grid, block, b.ptr().cast(), n as u64, 3) };
            assert_eq!(rc, 0, "divide_{}: no such kernel", cu_type(dtype));
            same(b.bytes(), &want, || {
                format!("divide_{} n={n}", cu_type(dtype))
            });
            assert!(
                b.guards_intact(),
                "divide_{} n={n}: outside",
                cu_type(dtype)
            );
        }
    }
}

#[test]
fn an_unknown_kernel_name_is_refused_by_the_harness() {
    // The harness's own check, so a misspelt name in the tests above cannot pass silently.
    let Some(lib) = lib_for("an_unknown_kernel_name_is_refused_by_the_harness") else {
        return;
    };
    let reduce: Reduce = sym(lib, "emu_reduce");
    let name = CString::new("reduce_avg_float").unwrap();
    let mut x = [0f32; 4];
    // SAFETY: an unknown name touches nothing.
    let rc = unsafe {
        reduce(
            name.as_ptr(),
            1,
            1,
            x.as_mut_ptr().cast(),
            x.as_ptr().cast(),
            4,
        )
    };
    assert_eq!(rc, -1);
}

/// Values of `T` from `n` random bit patterns of its width: every exponent, subnormals, zeros
/// of both signs and infinities; NaNs (whose payloads the device's `cvt` and the CPU's
/// conversions need not agree on) replaced by 1.5.
fn any_floats<T: Float + bytemuck::Pod>(n: usize, seed: u64) -> Vec<T> {
    let es = std::mem::size_of::<T>();
    let raw = noise(n * es, seed);
    bytemuck::cast_slice::<u8, T>(&raw)
        .iter()
        .map(|&x| {
            let mut w = [0f32; 1];
            T::widen(&[x], &mut w);
            if w[0].is_nan() {
                let mut r = [x];
                T::narrow(&[1.5], &mut r);
                r[0]
            } else {
                x
            }
        })
        .collect()
}

/// `n` values of `T` in [-2, 2) (see [`values`]).
fn small_floats<T: Float + bytemuck::Pod>(n: usize, seed: u64) -> Vec<T> {
    let f: Vec<f32> = values(DType::F32, n, seed)
        .chunks_exact(4)
        .map(|b| f32::from_ne_bytes(b.try_into().expect("4 bytes")))
        .collect();
    let mut out = vec![T::zeroed(); n];
    T::narrow(&f, &mut out);
    out
}

/// Run cast kernel `k` on `src` (its elements: as many as `want` holds) and compare with `want`.
fn check_cast(cast: Cast, (k, grid, block): (&str, u32, u32), src: &[u8], want: &[u8]) {
    let n = if k.ends_with("_float") {
        want.len() / 4
    } else {
        src.len() / 4
    };
    let mut got = Buf::new(want.len(), 0);
    let mut src = Buf::with(src, 0);
    let name = CString::new(k).unwrap();
    // SAFETY: `src` and `got` hold `n` elements of the kernel's source and destination types.
    let rc = unsafe {
        cast(
            name.as_ptr(),
            grid,
            block,
            src.ptr().cast(),
            got.ptr().cast(),
            n as u64,
        )
    };
    let what = format!("{k}, n={n}, grid {grid}x{block}");
    assert_eq!(rc, 0, "{what}: no such kernel");
    same(got.bytes(), want, || what.clone());
    assert!(got.guards_intact(), "{what}: outside");
}

fn float_kernels<T: Float + bytemuck::Pod>(lib: &libloading::Library, name: &str) {
    let (cast, scale, nonfinite, optim_step): (Cast, Scale, Nonfinite, OptimStep) = (
        sym(lib, "emu_cast"),
        sym(lib, "emu_scale"),
        sym(lib, "emu_nonfinite"),
        sym(lib, "emu_optim_step"),
    );
    let c = |k: &str| CString::new(format!("{k}_{name}")).unwrap();
    let bytes = |x: &[T]| bytemuck::cast_slice::<T, u8>(x).to_vec();
    for &n in &COUNTS {
        for &(grid, block) in &GRIDS[1..] {
            let what = format!("{name}, n={n}, grid {grid}x{block}");
            // Casts both ways (f32 → T over every f32 exponent, T → f32 over every T pattern).
            if name != "float" {
                let wide = any_floats::<f32>(n, n as u64);
                let mut want = vec![T::zeroed(); n];
                cpu::cast(&wide, &mut want);
                let k = format!("cast_float_{name}");
                check_cast(
                    cast,
                    (&k, grid, block),
                    bytemuck::cast_slice(&wide),
                    &bytes(&want),
                );

                let narrow = any_floats::<T>(n, n as u64 + 1);
                let mut want = vec![0f32; n];
                cpu::cast(&narrow, &mut want);
                let k = format!("cast_{name}_float");
                check_cast(
                    cast,
                    (&k, grid, block),
                    &bytes(&narrow),
                    bytemuck::cast_slice(&want),
                );
            }

            // Scale by a factor that is not a power of two (rounding happens).
            let x = small_floats::<T>(n, n as u64 + 2);
            let mut want = x.clone();
            cpu::scale(&mut want, 0.3);
            let mut b = Buf::with(&bytes(&x), 0);
            // SAFETY: the buffer holds n T.
            let rc = unsafe {
                scale(
                    c("scale").as_ptr(),
                    grid,
                    block,
                    b.ptr().cast(),
                    0.3,
                    n as u64,
                )
            };
            assert_eq!(rc, 0, "scale_{name}: no such kernel");
            same(b.bytes(), &bytes(&want), || format!("scale {what}"));
            assert!(b.guards_intact(), "scale {what}: outside");

            // Non-finite: none, then one infinity at the end (the tail of a grid stride).
            for poison_last in [false, true] {
                let mut x = small_floats::<T>(n, n as u64 + 3);
                if poison_last {
                    T::narrow(&[f32::INFINITY], &mut x[n - 1..]);
                }
                let mut flag = 0u32;
                let mut b = Buf::with(&bytes(&x), 0);
                // SAFETY: the buffer holds n T; `flag` is a live u32.
                let rc = unsafe {
                    nonfinite(
                        c("nonfinite").as_ptr(),
                        grid,
                        block,
                        b.ptr().cast(),
                        n as u64,
                        &mut flag,
                    )
                };
                assert_eq!(rc, 0, "nonfinite_{name}: no such kernel");
                assert_eq!(
                    flag != 0,
                    !cpu::all_finite(&x),
                    "nonfinite {what}, inf last: {poison_last}"
                );
                assert_eq!(flag != 0, poison_last, "nonfinite {what}");
            }

            // One step of every rule, with and without 16-bit parameters written back, on
            // aligned arrays (four elements at a time) and on arrays one element off (one at a
            // time). The states a rule does not keep are null, as the engine passes them empty.
            for h in Optimizer::each_rule() {
                // A constant step: `step_scalars` must give what `step_mixed` computes at run
                // time.
                let t = 3u64;
                let sc = h.step_scalars(t);
                let k = [
                    sc.lr, sc.b1, sc.b2, sc.eps, sc.decay, sc.l2, sc.bc1, sc.bc2, 0.5f32,
                ];
                let keeps = h.states().len();
                for (with_params, off) in [(false, 0), (true, 0), (true, 1), (false, 1)] {
                    let master0: Vec<f32> = small_floats::<f32>(n, n as u64 + 4);
                    let grads = small_floats::<T>(n, n as u64 + 5);
                    let len = |k: usize| if keeps >= k { n } else { 0 };
                    let m0: Vec<f32> = small_floats::<f32>(len(1), n as u64 + 6)
                        .iter()
                        .map(|x| x / 16.0)
                        .collect();
                    let v0: Vec<f32> = small_floats::<f32>(len(2), n as u64 + 7)
                        .iter()
                        .map(|x| x * x / 64.0)
                        .collect();
                    let (mut master, mut m, mut v) = (master0.clone(), m0.clone(), v0.clone());
                    let mut params = vec![T::zeroed(); n];
                    cpu::step_mixed(
                        &h,
                        t,
                        &mut master,
                        with_params.then_some(&mut params[..]),
                        &grads,
                        &mut m,
                        &mut v,
                        0.5,
                    );

                    let f32s = |x: &[f32]| Buf::with(bytemuck::cast_slice(x), 4 * off);
                    let (mut gm, mut gmom, mut gv) = (f32s(&master0), f32s(&m0), f32s(&v0));
                    let t_off = std::mem::size_of::<T>() * off;
                    let mut gp = Buf::new(n * std::mem::size_of::<T>(), t_off);
                    let mut gg = Buf::with(&bytes(&grads), t_off);
                    let pp = if with_params {
                        gp.ptr().cast()
                    } else {
                        std::ptr::null_mut()
                    };
                    let state = |b: &mut Buf, k: usize| {
                        if keeps >= k {
                            b.ptr().cast()
                        } else {
                            std::ptr::null_mut()
                        }
                    };
                    let (s1, s2) = (state(&mut gmom, 1), state(&mut gv, 2));
                    // SAFETY: every buffer holds n elements of its type; a null `params` is
                    // skipped, and a null state is one the rule does not keep.
                    let rc = unsafe {
                        optim_step(
                            c("optim_step").as_ptr(),
                            grid,
                            block,
                            gm.ptr().cast(),
                            pp,
                            gg.ptr().cast(),
                            s1,
                            s2,
                            n as u64,
                            sc.code,
                            k.as_ptr(),
                        )
                    };
                    assert_eq!(rc, 0, "optim_step_{name}: no such kernel");
                    let w = format!("{h:?} {what}, params {with_params}, off by {off}");
                    same(gm.bytes(), bytemuck::cast_slice(&master), || {
                        format!("{w}: master")
                    });
                    same(gmom.bytes(), bytemuck::cast_slice(&m), || {
                        format!("{w}: s1")
                    });
                    same(gv.bytes(), bytemuck::cast_slice(&v), || format!("{w}: s2"));
                    if with_params {
                        same(gp.bytes(), &bytes(&params), || format!("{w}: params"));
                    } else {
                        assert!(
                            gp.bytes().iter().all(|&b| b == POISON),
                            "{w}: params written"
                        );
                    }
                    assert!(
                        gm.guards_intact()
                            && gp.guards_intact()
                            && gmom.guards_intact()
                            && gv.guards_intact(),
                        "{w}: outside"
                    );
                }
            }
        }
    }
}

#[test]
fn casts_scale_nonfinite_and_every_optimizer_step_match_the_cpu_kernels() {
    let Some(lib) = lib_for("casts_scale_nonfinite_and_every_optimizer_step_match_the_cpu_kernels")
    else {
        return;
    };
    float_kernels::<f32>(lib, "float");
    float_kernels::<f16>(lib, "f16");
    float_kernels::<bf16>(lib, "bf16");
}

#[test]
fn the_squared_norm_adds_every_blocks_tree_once() {
    let Some(lib) = lib_for("the_squared_norm_adds_every_blocks_tree_once") else {
        return;
    };
    let sq_norm: SqNorm = sym(lib, "emu_sq_norm");
    fn one<T: Float + bytemuck::Pod>(sq_norm: SqNorm, name: &str) {
        // Block sizes the kernel's tree takes (the device launches 256), grids of one to three.
        for &(grid, block) in &[(1u32, 256u32), (3, 256), (2, 64), (1, 1)] {
            for &n in &[1usize, 3, 1023, 4099, 70_001] {
                let x = small_floats::<T>(n, n as u64 * 11 + u64::from(block));
                let want = cpu::sq_norm(&x, 0.75);
                let mut b = Buf::with(bytemuck::cast_slice(&x), 0);
                let mut got = 0f64;
                let k = CString::new(format!("sq_norm_{name}")).unwrap();
                // SAFETY: the buffer holds n T; `got` is a live f64 holding 0.
                let rc = unsafe {
                    sq_norm(
                        k.as_ptr(),
                        grid,
                        block,
                        b.ptr().cast(),
                        0.75,
                        n as u64,
                        &mut got,
                    )
                };
                assert_eq!(rc, 0, "sq_norm_{name}: no such kernel");
                // Summed in another order than the CPU's: equal to f64 rounding, not bit for bit.
                let what = format!("sq_norm_{name} n={n}, grid {grid}x{block}");
                assert!(
                    (got - want).abs() <= 1e-12 * want.abs(),
                    "{what}: {got} against {want}"
                );
            }
        }
    }
    one::<f32>(sq_norm, "float");
    one::<f16>(sq_norm, "f16");
    one::<bf16>(sq_norm, "bf16");
}
