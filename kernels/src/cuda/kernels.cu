// ringzero's device kernels, compiled at run time with NVRTC (no headers needed: 16-bit types are
// handled as raw bits and converted with PTX `cvt` or bit arithmetic). Every kernel is extern "C",
// named `<kernel>_<dtype>`, and walks its range with a grid-stride loop, so any grid covers any n.
//
// Semantics match the CPU kernels (kernels/src/cpu): f16/bf16 are widened to f32 for each pairwise
// combine and rounded back to nearest even; integers wrap; `divide` (the second half of Avg) divides
// in f32 (f64 for f64) and rounds once; integer division truncates toward zero.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned char u8;

struct f16 { u16 bits; };
struct bf16 { u16 bits; };

// (RINGZERO_HOST_EMULATION: the kernels compiled for the host by kernels/tests/emulated.rs,
// whose harness converts with the CPU's own IEEE instructions.)
__device__ __forceinline__ float widen(f16 x) {
#ifdef RINGZERO_HOST_EMULATION
    return host_f16_to_f32(x.bits);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
#endif
}
__device__ __forceinline__ f16 narrow_f16(float f) {
    f16 r;
#ifdef RINGZERO_HOST_EMULATION
    r.bits = host_f32_to_f16(f);
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
#endif
    return r;
}
__device__ __forceinline__ float widen(bf16 x) {
    return __uint_as_float(((u32)x.bits) << 16);
}
__device__ __forceinline__ bf16 narrow_bf16(float f) {
    u32 u = __float_as_uint(f);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (u16)((u >> 16) | 0x40u); // quiet NaN, sign kept
    } else {
        u32 rounding = 0x7fffu + ((u >> 16) & 1u); // round to nearest even
        r.bits = (u16)((u + rounding) >> 16);
    }
    return r;
}

// Per dtype: the type the arithmetic happens in (W), and the conversions.
template <typename T> struct Num;
template <> struct Num<float> {
    typedef float W;
    static __device__ __forceinline__ float up(float x) { return x; }
    static __device__ __forceinline__ float down(float x) { return x; }
};
template <> struct Num<double> {
    typedef double W;
    static __device__ __forceinline__ double up(double x) { return x; }
    static __device__ __forceinline__ double down(double x) { return x; }
};
template <> struct Num<f16> {
    typedef float W;
    static __device__ __forceinline__ float up(f16 x) { return widen(x); }
    static __device__ __forceinline__ f16 down(float x) { return narrow_f16(x); }
};
template <> struct Num<bf16> {
    typedef float W;
    static __device__ __forceinline__ float up(bf16 x) { return widen(x); }
    static __device__ __forceinline__ bf16 down(float x) { return narrow_bf16(x); }
};
// Integers compute in the unsigned type of the same width, so sum and product wrap (defined
// behaviour); min/max compare in the signed type.
template <> struct Num<int> {
    typedef int W;
    static __device__ __forceinline__ int up(int x) { return x; }
    static __device__ __forceinline__ int down(int x) { return x; }
};
template <> struct Num<i64> {
    typedef i64 W;
    static __device__ __forceinline__ i64 up(i64 x) { return x; }
    static __device__ __forceinline__ i64 down(i64 x) { return x; }
};
template <> struct Num<u8> {
    typedef u32 W;
    static __device__ __forceinline__ u32 up(u8 x) { return x; }
    static __device__ __forceinline__ u8 down(u32 x) { return (u8)x; }
};

template <typename W> __device__ __forceinline__ W op_sum(W a, W b) { return a + b; }
template <> __device__ __forceinline__ int op_sum(int a, int b) { return (int)((u32)a + (u32)b); }
template <> __device__ __forceinline__ i64 op_sum(i64 a, i64 b) { return (i64)((u64)a + (u64)b); }
template <typename W> __device__ __forceinline__ W op_prod(W a, W b) { return a * b; }
template <> __device__ __forceinline__ int op_prod(int a, int b) { return (int)((u32)a * (u32)b); }
template <> __device__ __forceinline__ i64 op_prod(i64 a, i64 b) { return (i64)((u64)a * (u64)b); }
// min/max propagate NaN like the CPU path (a NaN operand gives NaN).
template <typename W> __device__ __forceinline__ W op_min(W a, W b) { return (a != a) ? a : ((b != b) ? b : (b < a ? b : a)); }
template <typename W> __device__ __forceinline__ W op_max(W a, W b) { return (a != a) ? a : ((b != b) ? b : (b > a ? b : a)); }

#define GRID_STRIDE(i, n) for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// Ops as types, so one templated body serves every (op, dtype).
struct Sum { template <typename W> static __device__ __forceinline__ W f(W a, W b) { return op_sum<W>(a, b); } };
struct Prod { template <typename W> static __device__ __forceinline__ W f(W a, W b) { return op_prod<W>(a, b); } };
struct Min { template <typename W> static __device__ __forceinline__ W f(W a, W b) { return op_min<W>(a, b); } };
struct Max { template <typename W> static __device__ __forceinline__ W f(W a, W b) { return op_max<W>(a, b); } };

// 16 bytes moved as one load or store.
struct alignas(16) Vec16 { u32 w[4]; };

template <typename T, typename Op>
__device__ __forceinline__ T apply(T a, T b) {
    return Num<T>::down(Op::template f<typename Num<T>::W>(Num<T>::up(a), Num<T>::up(b)));
}

// dst = a OP b over n elements, and the same result to `also` when it is not null (the ring step
// whose result is both kept and sent: one pass instead of a combine and a copy that reads the
// result back). When every address is 16-byte aligned (the common case: allocations are, and
// slices start at multiples of the slot size), each thread moves 16 bytes per load and store — 8
// f16/bf16 or 16 u8 at a time; one element per load left a 2-byte type at about half of the copy
// bandwidth (the first H100 run: bf16 reduce at 56 % of a copy). The tail, and unaligned ranges,
// go element by element. dst may equal a: each thread reads its elements before writing them.
template <typename T, typename Op>
__device__ __forceinline__ void combine_body(T *dst, T *also, const T *a, const T *b, u64 n) {
    const u64 per = sizeof(Vec16) / sizeof(T);
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 done = 0;
    if ((((u64)dst | (u64)also | (u64)a | (u64)b) & 15) == 0) {
        const u64 vecs = n / per;
        const Vec16 *va = (const Vec16 *)a;
        const Vec16 *vb = (const Vec16 *)b;
        Vec16 *vd = (Vec16 *)dst;
        Vec16 *vo = (Vec16 *)also;
        for (u64 v = first; v < vecs; v += stride) {
            Vec16 x = va[v], y = vb[v], r;
            const T *xs = (const T *)&x;
            const T *ys = (const T *)&y;
            T *rs = (T *)&r;
#pragma unroll
            for (u64 k = 0; k < per; ++k) rs[k] = apply<T, Op>(xs[k], ys[k]);
            vd[v] = r;
            if (vo) vo[v] = r;
        }
        done = vecs * per;
    }
    for (u64 i = done + first; i < n; i += stride) {
        T r = apply<T, Op>(a[i], b[i]);
        dst[i] = r;
        if (also) also[i] = r;
    }
}

// dst[..bytes] = also[..bytes] = src[..bytes] (the all-gather step that keeps what it forwards),
// 16 bytes at a time when all three are aligned.
extern "C" __global__ void copy2(u8 *dst, u8 *also, const u8 *src, u64 bytes) {
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 done = 0;
    if ((((u64)dst | (u64)also | (u64)src) & 15) == 0) {
        const u64 vecs = bytes / sizeof(Vec16);
        for (u64 v = first; v < vecs; v += stride) {
            Vec16 x = ((const Vec16 *)src)[v];
            ((Vec16 *)dst)[v] = x;
            ((Vec16 *)also)[v] = x;
        }
        done = vecs * sizeof(Vec16);
    }
    for (u64 i = done + first; i < bytes; i += stride) {
        u8 x = src[i];
        dst[i] = x;
        also[i] = x;
    }
}

// Two unrelated copies in one launch: a[..a_bytes] from a_src, and b[..b_bytes] (and `b_also`
// when it is not null) from b_src. The ring's last all-gather step of a slice (a received slot
// into the output, host→device when the slot is staged in host memory) and the first step of the
// next slice (this rank's chunk into the next rank's slot, device→host) run together, so a staged
// link carries both directions at once instead of one after the other. The threads split the two
// ranges' 16-byte vectors between them when every address is aligned, else their bytes.
extern "C" __global__ void copy_pair(u8 *a, const u8 *a_src, u64 a_bytes, u8 *b, u8 *b_also,
                                     const u8 *b_src, u64 b_bytes) {
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const bool aligned =
        ((((u64)a | (u64)a_src | (u64)b | (u64)b_also | (u64)b_src) & 15) == 0);
    const u64 unit = aligned ? sizeof(Vec16) : 1;
    const u64 na = a_bytes / unit, nb = b_bytes / unit;
    for (u64 i = first; i < na + nb; i += stride) {
        if (aligned) {
            if (i < na) {
                ((Vec16 *)a)[i] = ((const Vec16 *)a_src)[i];
            } else {
                const u64 j = i - na;
                Vec16 x = ((const Vec16 *)b_src)[j];
                ((Vec16 *)b)[j] = x;
                if (b_also) ((Vec16 *)b_also)[j] = x;
            }
        } else if (i < na) {
            a[i] = a_src[i];
        } else {
            const u64 j = i - na;
            u8 x = b_src[j];
            b[j] = x;
            if (b_also) b_also[j] = x;
        }
    }
    // The aligned path's tails (fewer than 16 bytes each).
    if (aligned) {
        for (u64 i = na * unit + first; i < a_bytes; i += stride) a[i] = a_src[i];
        for (u64 j = nb * unit + first; j < b_bytes; j += stride) {
            u8 x = b_src[j];
            b[j] = x;
            if (b_also) b_also[j] = x;
        }
    }
}

// dst = dst OP src.
#define REDUCE(OP, NAME, T)                                                                      \
    extern "C" __global__ void reduce_##NAME##_##T(T *dst, const T *src, u64 n) {                \
        combine_body<T, OP>(dst, 0, dst, src, n);                                                \
    }

// dst = a OP b, three addresses (dst may equal a): the ring's fused step "local OP incoming"
// written straight to its destination, which may be a peer's slot or mapped host memory.
#define COMBINE(OP, NAME, T)                                                                     \
    extern "C" __global__ void combine_##NAME##_##T(T *dst, const T *a, const T *b, u64 n) {     \
        combine_body<T, OP>(dst, 0, a, b, n);                                                    \
    }

// dst = also = a OP b.
#define COMBINE2(OP, NAME, T)                                                                    \
    extern "C" __global__ void combine2_##NAME##_##T(T *dst, T *also, const T *a, const T *b,   \
                                                     u64 n) {                                    \
        combine_body<T, OP>(dst, also, a, b, n);                                                 \
    }

#define DIVIDE(T, D)                                                                             \
    extern "C" __global__ void divide_##T(T *buf, u64 n, int ranks) {                           \
        GRID_STRIDE(i, n) { buf[i] = Num<T>::down((Num<T>::W)((D)Num<T>::up(buf[i]) / (D)ranks)); } \
    }

#define ALL_OPS(T)                                                                               \
    REDUCE(Sum, sum, T)                                                                          \
    REDUCE(Prod, prod, T)                                                                        \
    REDUCE(Min, min, T)                                                                          \
    REDUCE(Max, max, T)                                                                          \
    COMBINE(Sum, sum, T)                                                                         \
    COMBINE(Prod, prod, T)                                                                       \
    COMBINE(Min, min, T)                                                                         \
    COMBINE(Max, max, T)                                                                         \
    COMBINE2(Sum, sum, T)                                                                        \
    COMBINE2(Prod, prod, T)                                                                      \
    COMBINE2(Min, min, T)                                                                        \
    COMBINE2(Max, max, T)

ALL_OPS(float)
ALL_OPS(double)
ALL_OPS(f16)
ALL_OPS(bf16)
ALL_OPS(int)
ALL_OPS(i64)
ALL_OPS(u8)
DIVIDE(float, float)
DIVIDE(double, double)
DIVIDE(f16, float)
DIVIDE(bf16, float)
DIVIDE(int, int)
DIVIDE(i64, i64)
DIVIDE(u8, u32)

// Up to 8 addresses, passed by value (the direct all-reduce's inputs or outputs, one per rank).
struct Ptrs8 { u64 p[8]; };

template <typename T, typename D>
__device__ __forceinline__ T divided(T x, int ranks) {
    return Num<T>::down((typename Num<T>::W)((D)Num<T>::up(x) / (D)ranks));
}

// The direct step of a node whose ranks all map each other's buffers: r = ins[0] OP ins[1] OP ...
// OP ins[nin-1], in that order and rounded to T after every operation (as the ring and the CPU
// kernels round), divided by `ranks` when it is not zero (average), and written to every outs[j]
// in the same pass. Every input is read once and every output written once, which is what lets
// ranks sharing one GPU reach the memory-bandwidth bound a slot ring cannot (it reads and writes
// each slice again in the slots). An output may equal an input (in place): each thread reads all
// of its elements before it writes any. 16 bytes per load and store when every address is aligned.
template <typename T, typename Op, typename D>
__device__ __forceinline__ void gather_body(Ptrs8 ins, u32 nin, Ptrs8 outs, u32 nout, u64 n,
                                            int ranks) {
    const u64 per = sizeof(Vec16) / sizeof(T);
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 any = 0;
#pragma unroll
    for (u32 k = 0; k < 8; ++k) any |= (k < nin ? ins.p[k] : 0) | (k < nout ? outs.p[k] : 0);
    u64 done = 0;
    if ((any & 15) == 0) {
        const u64 vecs = n / per;
        for (u64 v = first; v < vecs; v += stride) {
            // Every load is issued before the first is used (unrolled over the 8 slots with
            // constant indices, which also keeps the pointers in registers, not a local copy of
            // the parameter), so one thread has all of its inputs in flight at once.
            Vec16 x[8];
#pragma unroll
            for (u32 k = 0; k < 8; ++k)
                if (k < nin) x[k] = ((const Vec16 *)ins.p[k])[v];
            T *rs = (T *)&x[0];
#pragma unroll
            for (u32 k = 1; k < 8; ++k) {
                if (k < nin) {
                    const T *xs = (const T *)&x[k];
#pragma unroll
                    for (u64 e = 0; e < per; ++e) rs[e] = apply<T, Op>(rs[e], xs[e]);
                }
            }
            if (ranks) {
#pragma unroll
                for (u64 e = 0; e < per; ++e) rs[e] = divided<T, D>(rs[e], ranks);
            }
#pragma unroll
            for (u32 j = 0; j < 8; ++j)
                if (j < nout) ((Vec16 *)outs.p[j])[v] = x[0];
        }
        done = vecs * per;
    }
    for (u64 i = done + first; i < n; i += stride) {
        T x[8];
#pragma unroll
        for (u32 k = 0; k < 8; ++k)
            if (k < nin) x[k] = ((const T *)ins.p[k])[i];
        T r = x[0];
#pragma unroll
        for (u32 k = 1; k < 8; ++k)
            if (k < nin) r = apply<T, Op>(r, x[k]);
        if (ranks) r = divided<T, D>(r, ranks);
#pragma unroll
        for (u32 j = 0; j < 8; ++j)
            if (j < nout) ((T *)outs.p[j])[i] = r;
    }
}

#define GATHER(OP, NAME, T, D)                                                                   \
    extern "C" __global__ void gather_##NAME##_##T(Ptrs8 ins, u32 nin, Ptrs8 outs, u32 nout,     \
                                                   u64 n, int ranks) {                           \
        gather_body<T, OP, D>(ins, nin, outs, nout, n, ranks);                                   \
    }
#define GATHERS(T, D)                                                                            \
    GATHER(Sum, sum, T, D)                                                                       \
    GATHER(Prod, prod, T, D)                                                                     \
    GATHER(Min, min, T, D)                                                                       \
    GATHER(Max, max, T, D)
GATHERS(float, float)
GATHERS(double, double)
GATHERS(f16, float)
GATHERS(bf16, float)
GATHERS(int, int)
GATHERS(i64, i64)
GATHERS(u8, u32)

// Casts between the float training types.
#define CAST(A, B)                                                                               \
    extern "C" __global__ void cast_##A##_##B(const A *src, B *dst, u64 n) {                    \
        GRID_STRIDE(i, n) { dst[i] = Num<B>::down(Num<A>::up(src[i])); }                         \
    }
CAST(float, f16)
CAST(float, bf16)
CAST(f16, float)
CAST(bf16, float)

// An optimizer step's scalars, as the launch passes them (`cpu::StepScalars`, and the scale).
struct StepScalars { float lr, b1, b2, eps, decay, l2, bc1, bc2, grad_scale; };

// sign(c): 1, -1, or 0 for zero and NaN (as the CPU kernel).
__device__ __forceinline__ float sign_of(float c) {
    return c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
}

// One element's step of rule R (`StepScalars::code`: 0 AdamW, 1 Adam, 2 Lion, 3 SGD, 4 SGD with
// momentum, 5 Nesterov), in the CPU kernel's operation order (fmad off: the same bits).
template <int R, typename T>
__device__ __forceinline__ void step_one(float &p, float &s1, float &s2, T grad,
                                         const StepScalars &k) {
    float g = Num<T>::up(grad) * k.grad_scale;
    if (R == 0 || R == 1) {
        if (k.l2 != 0.0f) g = g + k.l2 * p;
        s1 = k.b1 * s1 + (1.0f - k.b1) * g;
        s2 = k.b2 * s2 + (1.0f - k.b2) * g * g;
        float update = (s1 / k.bc1) / (sqrtf(s2 / k.bc2) + k.eps);
        p = p * k.decay - k.lr * update;
    } else if (R == 2) {
        float c = k.b1 * s1 + (1.0f - k.b1) * g;
        p = p * k.decay - k.lr * sign_of(c);
        s1 = k.b2 * s1 + (1.0f - k.b2) * g;
    } else if (R == 3) {
        if (k.l2 != 0.0f) g = g + k.l2 * p;
        p = p - k.lr * g;
    } else {
        if (k.l2 != 0.0f) g = g + k.l2 * p;
        s1 = k.b1 * s1 + g;
        float d = R == 5 ? g + k.b1 * s1 : s1;
        p = p - k.lr * d;
    }
}

// Four consecutive elements of T, loaded and stored as one access.
template <typename T> struct alignas(4 * sizeof(T)) Quad { T e[4]; };

// Rule R over n elements; the states it keeps (`S1`, `S2`) are read and written, the others never
// touched (their pointers may be null). When every array is aligned to four of its elements
// (allocations are; a shard's range may not be), each thread takes four at a time: 16-byte loads
// of the master and states, 8 bytes of 16-bit gradients. One element per thread and iteration kept
// too few bytes in flight for HBM3e (the first H200 run: bf16 at 78 % of a copy against 88 % on
// an H100). The tail and unaligned ranges go one element at a time.
template <int R, typename T>
__device__ __forceinline__ void step_body(float *master, T *params, const T *grads, float *s1,
                                          float *s2, u64 n, const StepScalars &k) {
    const bool S1 = R != 3, S2 = R <= 1;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 wide = 4 * sizeof(float) - 1, narrow = 4 * sizeof(T) - 1;
    const u64 states = (S1 ? (u64)s1 : 0) | (S2 ? (u64)s2 : 0);
    u64 done = 0;
    if ((((u64)master | states) & wide) == 0 && (((u64)grads | (u64)params) & narrow) == 0) {
        const u64 quads = n / 4;
        for (u64 q = first; q < quads; q += stride) {
            Quad<float> p = ((const Quad<float> *)master)[q];
            Quad<float> a = {{0.0f, 0.0f, 0.0f, 0.0f}}, b = {{0.0f, 0.0f, 0.0f, 0.0f}};
            if (S1) a = ((const Quad<float> *)s1)[q];
            if (S2) b = ((const Quad<float> *)s2)[q];
            Quad<T> g = ((const Quad<T> *)grads)[q];
#pragma unroll
            for (int e = 0; e < 4; ++e) step_one<R, T>(p.e[e], a.e[e], b.e[e], g.e[e], k);
            if (S1) ((Quad<float> *)s1)[q] = a;
            if (S2) ((Quad<float> *)s2)[q] = b;
            ((Quad<float> *)master)[q] = p;
            if (params) {
                Quad<T> out;
#pragma unroll
                for (int e = 0; e < 4; ++e) out.e[e] = Num<T>::down(p.e[e]);
                ((Quad<T> *)params)[q] = out;
            }
        }
        done = quads * 4;
    }
    for (u64 i = done + first; i < n; i += stride) {
        float p = master[i], a = S1 ? s1[i] : 0.0f, b = S2 ? s2[i] : 0.0f;
        step_one<R, T>(p, a, b, grads[i], k);
        if (S1) s1[i] = a;
        if (S2) s2[i] = b;
        master[i] = p;
        if (params) params[i] = Num<T>::down(p);
    }
}

#define FLOAT_KERNELS(T)                                                                         \
    extern "C" __global__ void scale_##T(T *buf, float s, u64 n) {                              \
        GRID_STRIDE(i, n) { buf[i] = Num<T>::down(Num<T>::up(buf[i]) * s); }                     \
    }                                                                                            \
    /* Σ (x·s)² in f64: per-thread partial sums, a shared-memory tree per block, one atomic. */  \
    extern "C" __global__ void sq_norm_##T(const T *x, float s, u64 n, double *out) {           \
        __shared__ double part[256];                                                             \
        double acc = 0.0;                                                                        \
        GRID_STRIDE(i, n) {                                                                      \
            double v = (double)(Num<T>::up(x[i]) * s);                                           \
            acc += v * v;                                                                        \
        }                                                                                        \
        part[threadIdx.x] = acc;                                                                 \
        __syncthreads();                                                                         \
        for (u32 w = blockDim.x / 2; w > 0; w >>= 1) {                                           \
            if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];                     \
            __syncthreads();                                                                     \
        }                                                                                        \
        if (threadIdx.x == 0) atomicAdd(out, part[0]);                                           \
    }                                                                                            \
    /* Sets *flag to 1 if any element is inf or NaN. */                                          \
    extern "C" __global__ void nonfinite_##T(const T *x, u64 n, u32 *flag) {                    \
        GRID_STRIDE(i, n) {                                                                      \
            float v = Num<T>::up(x[i]);                                                          \
            if (!isfinite(v)) { *flag = 1u; }                                                    \
        }                                                                                        \
    }                                                                                            \
    /* One optimizer step on fp32 master and states from T gradients; 16-bit params written   \
       from the master (params may be null). Same operation order as the CPU kernel. */         \
    extern "C" __global__ void optim_step_##T(float *master, T *params, const T *grads,         \
                                              float *s1, float *s2, u64 n, u32 rule, float lr,  \
                                              float b1, float b2, float eps, float decay,       \
                                              float l2, float bc1, float bc2,                   \
                                              float grad_scale) {                                \
        const StepScalars k = {lr, b1, b2, eps, decay, l2, bc1, bc2, grad_scale};              \
        switch (rule) {                                                                          \
        case 0: step_body<0, T>(master, params, grads, s1, s2, n, k); break;                     \
        case 1: step_body<1, T>(master, params, grads, s1, s2, n, k); break;                     \
        case 2: step_body<2, T>(master, params, grads, s1, s2, n, k); break;                     \
        case 3: step_body<3, T>(master, params, grads, s1, s2, n, k); break;                     \
        case 4: step_body<4, T>(master, params, grads, s1, s2, n, k); break;                     \
        default: step_body<5, T>(master, params, grads, s1, s2, n, k); break;                    \
        }                                                                                        \
    }

FLOAT_KERNELS(float)
FLOAT_KERNELS(f16)
FLOAT_KERNELS(bf16)
