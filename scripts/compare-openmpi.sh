#!/usr/bin/env bash
# ringzero against Open MPI on this machine, side by side in one run: all-reduce, reduce-scatter
# and all-gather of f32 (sum), out of place, 2 ranks, 4 KiB to 64 MiB, over shared memory (Open
# MPI's `vader` BTL, ringzero's shm edges) and over loopback TCP (`tcp` BTL, tcp edges), and the
# shm all-gather twice more: through the slots alone (RINGZERO_SINGLE_COPY_FROM=off, the `slots`
# column) and from ringzero::SharedBuf buffers (`ringzero bench --shared-buffers`, the `shared`
# column: the other ranks' parts read through kept mappings, as nccl-tests' -R registers its
# buffers; Open MPI's side keeps its malloc'd buffers, which is all MPI_Allgather can take). Prints the ratio of bus bandwidths, ringzero / Open MPI, per size (above 1: ringzero is faster). Each
# side runs REPEATS times (default 3), the two interleaved, and each cell takes each side's best:
# a shared or virtual machine's speed drifts by several times over a minute, and the best of
# interleaved runs compares the two at their own best rather than at two moments.
# A second table sets each side's median run against the other's.
# A benchmark, not a test: figures from one machine belong in docs/, as ratios from one run.
#
#     apt-get install openmpi-bin libopenmpi-dev     # Open MPI 4.1 on Debian 12
#     cargo build --release && scripts/compare-openmpi.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
for t in mpicc mpirun python3; do
    command -v "$t" > /dev/null || {
        echo "compare-openmpi: $t not found; install Open MPI (apt-get install openmpi-bin libopenmpi-dev)" >&2
        exit 2
    }
done
B=target/release/ringzero
[ -x "$B" ] || { echo "compare-openmpi: build ringzero first: cargo build --release" >&2; exit 2; }
out=${1:-$(mktemp -d)}
mkdir -p "$out"
mpicc -O2 -o "$out/mpi_bench" scripts/mpi_bench.c
# Both sides time their calls back to back: ringzero's model is measured once at the start
# (`--model start`), not in groups between its timed calls as `--model row` does, whose
# streams and copies would leave each group's first call colder caches than Open MPI's loop.
rz=(bench --model start)
# Open MPI refuses root unless told; a container's root is the usual case here.
root=()
[ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
for rep in $(seq "${REPEATS:-3}"); do
    for tr in shm tcp; do
        btl=vader,self
        [ "$tr" = tcp ] && btl=tcp,self
        mpirun "${root[@]}" --oversubscribe -n 2 --mca btl "$btl" "$out/mpi_bench" \
            > "$out/mpi-$tr-$rep.txt"
        for op in all-reduce reduce-scatter all-gather; do
            "$B" "${rz[@]}" "$op" -n 2 --transport "$tr" -b 4K -e 64M -f 4 \
                --json "$out/rz-$tr-$op-$rep.json" > /dev/null
        done
        # The all-gather through the slots alone, beside the default's single copy from 64 KiB.
        [ "$tr" = shm ] && RINGZERO_SINGLE_COPY_FROM=off "$B" "${rz[@]}" all-gather -n 2 \
            --transport shm -b 4K -e 64M -f 4 --json "$out/rz-slots-all-gather-$rep.json" > /dev/null
        [ "$tr" = shm ] && "$B" "${rz[@]}" all-gather -n 2 --transport shm -b 4K -e 64M -f 4 \
            --shared-buffers --json "$out/rz-shared-all-gather-$rep.json" > /dev/null
        true
    done
done
python3 - "$out" <<'PY'
import json, sys, glob, os, statistics
out = sys.argv[1]
# Every run's busbw per cell, each side's runs apart.
mpi, rz = {}, {}
def add(d, k, v):
    d.setdefault(k, []).append(v)
for tr in ("shm", "tcp"):
    for f in glob.glob(os.path.join(out, f"mpi-{tr}-*.txt")):
        for line in open(f):
            op, size, _, bw = line.split()
            add(mpi, (tr, op, int(size)), float(bw))
    for f in glob.glob(os.path.join(out, f"rz-{tr}-*.json")):
        for r in json.load(open(f))["rows"]:
            if not r["inplace"]:
                add(rz, (tr, r["op"], r["bytes"]), r["busbw_gbs"])
for kind in ("slots", "shared"):
    for f in glob.glob(os.path.join(out, f"rz-{kind}-*.json")):
        for r in json.load(open(f))["rows"]:
            if not r["inplace"]:
                add(rz, ("shm", f"all_gather {kind}", r["bytes"]), r["busbw_gbs"])
ops = ("all_reduce", "reduce_scatter", "all_gather")
cols = [(tr, op) for tr in ("shm", "tcp") for op in ops]
cols[3:3] = [("shm", "all_gather slots"), ("shm", "all_gather shared")]
def human(b):
    for unit, s in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << s and b % (1 << s) == 0:
            return f"{b >> s} {unit}"
    return f"{b} B"
def table(title, pick):
    print(title)
    print(f"{'size':>8} " + " ".join(f"{op.replace('_', '-')[:16]+' '+tr:>20}" for tr, op in cols))
    for size in sorted({k[2] for k in mpi}):
        cells = []
        for tr, op in cols:
            a, b = rz.get((tr, op, size)), mpi.get((tr, op.split()[0], size))
            cells.append(f"{pick(a) / pick(b):>19.2f}x" if a and b else f"{'-':>20}")
        print(f"{human(size):>8} " + " ".join(cells))
table("busbw ringzero / Open MPI (2 ranks, f32 sum, out of place, best of each side's runs; "
      "above 1: ringzero faster)", max)
# The medians say what a typical run of each side gives; where the two tables disagree, the
# machine's swings are as large as the difference.
table("\nthe same, median of each side's runs", statistics.median)
PY
echo "compare-openmpi: raw figures in $out"
