/* The Open MPI side of scripts/compare-openmpi.sh: all-reduce, reduce-scatter and all-gather of
 * f32 (sum), out of place, sizes 4 KiB to 64 MiB by 4, timed as ringzero bench and nccl-tests
 * time them: warm-up calls, then the mean time per call over the timed ones, the slowest rank's.
 * Sizes are the whole buffer (all-reduce: each rank's buffer; reduce-scatter: the input;
 * all-gather: the output); bus bandwidth uses nccl-tests' factors. One line per row:
 *   OP BYTES TIME_US BUSBW_GBS
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One call of collective `op` on `bytes` (see the top). */
static void call(int op, size_t bytes, int n, const float *in, float *out) {
    size_t count = bytes / sizeof(float), part = count / (size_t)n;
    if (op == 0)
        MPI_Allreduce(in, out, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else if (op == 1)
        MPI_Reduce_scatter_block(in, out, (int)part, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else
        MPI_Allgather(in, (int)part, MPI_FLOAT, out, (int)part, MPI_FLOAT, MPI_COMM_WORLD);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    const size_t max = 64u << 20;
    float *in = malloc(max), *out = malloc(max);
    for (size_t i = 0; i < max / sizeof(float); i++) in[i] = (float)((i + rank) % 7);
    memset(out, 0, max);
    const char *names[3] = {"all_reduce", "reduce_scatter", "all_gather"};
    for (int op = 0; op < 3; op++) {
        for (size_t bytes = 4096; bytes <= max; bytes *= 4) {
            int iters = bytes >= (16u << 20) ? 10 : 50;
            for (int i = 0; i < 5; i++) call(op, bytes, n, in, out); /* warm-up */
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            for (int i = 0; i < iters; i++) call(op, bytes, n, in, out);
            double mine = (MPI_Wtime() - t0) / iters, worst = 0;
            MPI_Reduce(&mine, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
            if (rank == 0) {
                double factor = op == 0 ? 2.0 * (n - 1) / n : (double)(n - 1) / n;
                printf("%s %zu %.2f %.4f\n", names[op], bytes, worst * 1e6,
                       factor * (double)bytes / worst / 1e9);
            }
        }
    }
    free(in);
    free(out);
    MPI_Finalize();
    return 0;
}
