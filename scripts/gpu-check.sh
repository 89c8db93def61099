#!/usr/bin/env bash
# The one GPU check: run on a machine with an NVIDIA GPU, from the repository root, with the
# binaries built beforehand on an x86-64 machine (no CUDA needed there) and carried:
#     cargo build --release && cargo test --release --no-run -p ringzero-kernels --test cuda
# It builds nothing. It runs every GPU test and micro-benchmark and prints a table last.
set -uo pipefail
cd "$(dirname "$0")/.."
# NVRTC (libnvrtc.so.13) on LD_LIBRARY_PATH.
. scripts/nvrtc-path.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
status=0
# The kernels' cargo tests (NoCuda path, NVRTC compilation) as carried test binaries.
for t in target/release/deps/cuda-*; do
    [ -x "$t" ] && [ -f "$t" ] || continue
    echo "== $t"
    "$t" --nocapture || status=1
done
out=${OUT:-/tmp}
# diag on the real machine: CUDA devices, peer facts, peer/pinned copies, IPC and the ring, each
# probe in a child under the watchdog. Exit 1 (degraded) is a finding, not a failure of the check.
echo "== ringzero diag --json"
timeout -k 5 300 target/release/ringzero diag --json > "$out/diag.json"
diag_rc=$?
python3 - "$out/diag.json" "$diag_rc" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
print("diag exit code", sys.argv[2], "|", r["cuda"]["note"])
for p in r["probes"]:
    gbs = "" if p["gbs"] is None else f' {p["gbs"]:.1f} GB/s'
    print(f'  {p["name"]:<22} {p["status"]}{gbs}: {p["detail"][:140]}')
PY
[ "$diag_rc" -le 1 ] || status=1
# Every rank below is a process on the one GPU. Without MPS the GPU time-slices between processes,
# and each slice of the ring waits for a context switch; with MPS their kernels run side by side.
# So the benches run both ways, and `ringzero gpu-check` runs under MPS when this script can start
# it (and stops it after); an MPS daemon already running is left alone.
bench() {  # label, then env assignments and bench arguments
    local label=$1; shift
    echo "== $label"
    env "$@" --json "$out/bench-$label.json" | grep -E '^ +[0-9]|edge|rror|device (baseline|bound|ring)' || status=1
}
B=target/release/ringzero
A="all-reduce --device cuda -b 4M -e 256M -f 4 --iters 10 --warmup 3"
for n in 2 4; do
    bench "cuda_ipc-n$n" timeout -k 5 120 $B bench $A -n "$n"
done
# Host staging (P2P disabled) both ways: kernels on the mapped slots, and explicit copies through
# device scratch (RINGZERO_STAGING=copy). The issue asks to measure both.
for staging in mapped copy; do
    bench "staging-$staging-n2" RINGZERO_P2P_DISABLE=1 RINGZERO_STAGING=$staging \
        timeout -k 5 120 $B bench $A -n 2
done
mps=0
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/ringzero-mps} \
       CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/ringzero-mps-log}
if command -v nvidia-cuda-mps-control >/dev/null && [ ! -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && mps=1 && echo "== MPS daemon started for the runs below"
fi
if [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then
    for n in 2 4; do
        bench "mps-cuda_ipc-n$n" timeout -k 5 120 $B bench $A -n "$n"
        # The slot ring beside the direct step auto takes on one GPU, in the same session.
        bench "mps-ring-cuda_ipc-n$n" RINGZERO_DEVICE_ALGO=ring timeout -k 5 120 $B bench $A -n "$n"
    done
    # All-to-all on 4 ranks: the direct pulls against the store-and-forward ring.
    A2A="all-to-all --device cuda -b 16M -e 256M -f 4 --iters 10 --warmup 3 -n 4"
    bench "mps-a2a-cuda_ipc-n4" timeout -k 5 120 $B bench $A2A
    bench "mps-a2a-ring-cuda_ipc-n4" RINGZERO_DEVICE_ALGO=ring timeout -k 5 120 $B bench $A2A
    bench "mps-staging-n2" RINGZERO_P2P_DISABLE=1 timeout -k 5 120 $B bench $A -n 2
    # The copy pair (a slice's last receive with the next slice's first send) against none, in
    # the same session: what it is worth where the two directions of a staged link take turns.
    bench "mps-staging-nopairs-n2" RINGZERO_P2P_DISABLE=1 RINGZERO_DEVICE_COPY_PAIRS=off \
        timeout -k 5 120 $B bench $A -n 2
    # Kernels on the mapped slots against the copy lanes (the default).
    bench "mps-staging-mapped-n2" RINGZERO_P2P_DISABLE=1 RINGZERO_STAGING=mapped \
        timeout -k 5 120 $B bench $A -n 2
else
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "== no MPS: gpu-check's ranks time-slice the GPU"
fi
timeout -k 10 600 $B gpu-check --json "$out/gpu-check.json" || status=1
[ "$mps" = 1 ] && echo quit | nvidia-cuda-mps-control
exit $status
