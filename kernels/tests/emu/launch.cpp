// The device kernels' own source (kernels/src/cuda/kernels.cu), compiled for the host so that
// kernels/tests/emulated.rs can check their index arithmetic against the CPU kernels without a
// GPU. A launch runs every thread of the grid, one after another: each kernel walks its range
// with a grid-stride loop and its threads touch disjoint elements, so the order cannot change
// the result. The one kernel whose threads cooperate (sq_norm_*: a shared-memory tree per block
// with __syncthreads) runs each block's threads as host threads meeting at a barrier instead.
// The GPU check (`ringzero gpu-check`) runs the same kernels on the device.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <condition_variable>
#include <immintrin.h>
#include <mutex>
#include <thread>
#include <vector>

using std::isfinite;
using std::sqrt;

#define RINGZERO_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
// Shared by a block's threads; blocks run one after another, and one cooperative launch at a
// time (`launch_block_threads`).
#define __shared__ static
#define __syncthreads() block_barrier->wait()

// __syncthreads for one block's host threads.
struct Barrier {
    std::mutex m;
    std::condition_variable cv;
    unsigned n, waiting = 0, generation = 0;
    explicit Barrier(unsigned n) : n(n) {}
    void wait() {
        std::unique_lock<std::mutex> lock(m);
        unsigned gen = generation;
        if (++waiting == n) {
            waiting = 0;
            ++generation;
            cv.notify_all();
        } else {
            cv.wait(lock, [&] { return generation != gen; });
        }
    }
};
static Barrier *block_barrier = nullptr;

struct Dim {
    unsigned x;
};
// Per host thread: the Rust tests launch from several threads at once.
static thread_local Dim blockIdx, threadIdx, blockDim, gridDim;

static inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static inline double atomicAdd(double *p, double v) {
    double old = *p;
    *p += v;
    return old;
}
// F16C: IEEE conversions, round to nearest even, subnormals kept (as `cvt.rn` on the device).
static inline float host_f16_to_f32(unsigned short h) { return _cvtsh_ss(h); }
static inline unsigned short host_f32_to_f16(float f) {
    return (unsigned short)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

#include "../../src/cuda/kernels.cu"

// Run `body` once per thread of a `grid` × `block` launch.
template <typename F> static void launch(unsigned grid, unsigned block, F body) {
    gridDim.x = grid;
    blockDim.x = block;
    for (unsigned g = 0; g < grid; ++g) {
        for (unsigned t = 0; t < block; ++t) {
            blockIdx.x = g;
            threadIdx.x = t;
            body();
        }
    }
}

// Run `body` as a `grid` × `block` launch whose block's threads run at once, as host threads
// (for kernels that synchronise within a block); one such launch at a time.
template <typename F> static void launch_block_threads(unsigned grid, unsigned block, F body) {
    static std::mutex one;
    std::lock_guard<std::mutex> only(one);
    for (unsigned g = 0; g < grid; ++g) {
        Barrier bar(block);
        block_barrier = &bar;
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < block; ++t) {
            threads.emplace_back([&, g, t] {
                gridDim.x = grid;
                blockDim.x = block;
                blockIdx.x = g;
                threadIdx.x = t;
                body();
            });
        }
        for (auto &th : threads) th.join();
        block_barrier = nullptr;
    }
}

#define EACH_OP(X, T) X(sum, T) X(prod, T) X(min, T) X(max, T)
#define EACH_TYPE(X)                                                                             \
    EACH_OP(X, float)                                                                            \
    EACH_OP(X, double) EACH_OP(X, f16) EACH_OP(X, bf16) EACH_OP(X, int) EACH_OP(X, i64)          \
        EACH_OP(X, u8)

extern "C" {

void emu_copy_pair(unsigned grid, unsigned block, u8 *a, const u8 *a_src, u64 a_bytes, u8 *b,
                   u8 *b_also, const u8 *b_src, u64 b_bytes) {
    launch(grid, block, [&] { copy_pair(a, a_src, a_bytes, b, b_also, b_src, b_bytes); });
}

void emu_copy2(unsigned grid, unsigned block, u8 *dst, u8 *also, const u8 *src, u64 bytes) {
    launch(grid, block, [&] { copy2(dst, also, src, bytes); });
}

// The kernels named by `name`; -1 for a name the source does not define.
int emu_combine2(const char *name, unsigned grid, unsigned block, void *dst, void *also,
                 const void *a, const void *b, u64 n) {
#define TRY(OP, T)                                                                               \
    if (!strcmp(name, "combine2_" #OP "_" #T)) {                                                 \
        launch(grid, block, [&] {                                                                \
            combine2_##OP##_##T((T *)dst, (T *)also, (const T *)a, (const T *)b, n);             \
        });                                                                                      \
        return 0;                                                                                \
    }
    EACH_TYPE(TRY)
#undef TRY
    return -1;
}

int emu_reduce(const char *name, unsigned grid, unsigned block, void *dst, const void *src,
               u64 n) {
#define TRY(OP, T)                                                                               \
    if (!strcmp(name, "reduce_" #OP "_" #T)) {                                                   \
        launch(grid, block, [&] { reduce_##OP##_##T((T *)dst, (const T *)src, n); });            \
        return 0;                                                                                \
    }
    EACH_TYPE(TRY)
#undef TRY
    return -1;
}

int emu_gather(const char *name, unsigned grid, unsigned block, const u64 *ins, u32 nin,
               const u64 *outs, u32 nout, u64 n, int ranks) {
    if (nin > 8 || nout > 8) return -2;
    Ptrs8 in = {}, out = {};
    for (u32 k = 0; k < nin; ++k) in.p[k] = ins[k];
    for (u32 k = 0; k < nout; ++k) out.p[k] = outs[k];
#define TRY(OP, T)                                                                               \
    if (!strcmp(name, "gather_" #OP "_" #T)) {                                                   \
        launch(grid, block, [&] { gather_##OP##_##T(in, nin, out, nout, n, ranks); });           \
        return 0;                                                                                \
    }
    EACH_TYPE(TRY)
#undef TRY
    return -1;
}

int emu_cast(const char *name, unsigned grid, unsigned block, const void *src, void *dst, u64 n) {
#define TRY(A, B)                                                                                \
    if (!strcmp(name, "cast_" #A "_" #B)) {                                                      \
        launch(grid, block, [&] { cast_##A##_##B((const A *)src, (B *)dst, n); });               \
        return 0;                                                                                \
    }
    TRY(float, f16) TRY(float, bf16) TRY(f16, float) TRY(bf16, float)
#undef TRY
    return -1;
}

#define EACH_FLOAT(X) X(float) X(f16) X(bf16)

int emu_scale(const char *name, unsigned grid, unsigned block, void *buf, float s, u64 n) {
#define TRY(T)                                                                                   \
    if (!strcmp(name, "scale_" #T)) {                                                            \
        launch(grid, block, [&] { scale_##T((T *)buf, s, n); });                                 \
        return 0;                                                                                \
    }
    EACH_FLOAT(TRY)
#undef TRY
    return -1;
}

int emu_nonfinite(const char *name, unsigned grid, unsigned block, const void *x, u64 n,
                  u32 *flag) {
#define TRY(T)                                                                                   \
    if (!strcmp(name, "nonfinite_" #T)) {                                                        \
        launch(grid, block, [&] { nonfinite_##T((const T *)x, n, flag); });                      \
        return 0;                                                                                \
    }
    EACH_FLOAT(TRY)
#undef TRY
    return -1;
}

// An optimizer step: `rule` is `StepScalars::code`; `k` holds lr, b1, b2, eps, decay, l2, bc1,
// bc2, grad_scale in the kernel's order.
int emu_optim_step(const char *name, unsigned grid, unsigned block, float *master, void *params,
                   const void *grads, float *s1, float *s2, u64 n, unsigned rule, const float *k) {
#define TRY(T)                                                                                   \
    if (!strcmp(name, "optim_step_" #T)) {                                                       \
        launch(grid, block, [&] {                                                                \
            optim_step_##T(master, (T *)params, (const T *)grads, s1, s2, n, rule, k[0], k[1],    \
                           k[2], k[3], k[4], k[5], k[6], k[7], k[8]);                            \
        });                                                                                      \
        return 0;                                                                                \
    }
    EACH_FLOAT(TRY)
#undef TRY
    return -1;
}

// `out` must hold 0.0 before the call (the kernel adds each block's sum to it).
int emu_sq_norm(const char *name, unsigned grid, unsigned block, const void *x, float s, u64 n,
                double *out) {
    if (block == 0 || block > 256 || (block & (block - 1))) return -2; // the kernel's tree
#define TRY(T)                                                                                   \
    if (!strcmp(name, "sq_norm_" #T)) {                                                          \
        launch_block_threads(grid, block, [&] { sq_norm_##T((const T *)x, s, n, out); });        \
        return 0;                                                                                \
    }
    EACH_FLOAT(TRY)
#undef TRY
    return -1;
}

int emu_divide(const char *name, unsigned grid, unsigned block, void *buf, u64 n, int ranks) {
#define TRY(T)                                                                                   \
    if (!strcmp(name, "divide_" #T)) {                                                           \
        launch(grid, block, [&] { divide_##T((T *)buf, n, ranks); });                            \
        return 0;                                                                                \
    }
    TRY(float) TRY(double) TRY(f16) TRY(bf16) TRY(int) TRY(i64) TRY(u8)
#undef TRY
    return -1;
}

}
