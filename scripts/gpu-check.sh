#!/usr/bin/env bash
# The one GPU check: run on a machine with an NVIDIA GPU, from the repository root, with the
# binaries built beforehand on an x86-64 machine (no CUDA needed there) and carried:
#     cargo build --release && cargo test --release --no-run -p ringzero-kernels --test cuda
# It builds nothing. It runs every GPU test and micro-benchmark and prints a table last.
set -uo pipefail
cd "$(dirname "$0")/.."
# NVRTC (libnvrtc.so.13): the CUDA toolkit's, or the one PyTorch's image carries as a wheel.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    [ -e "$d/libnvrtc.so.13" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
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
target/release/ringzero diag --json > "$out/diag.json"
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
# ringzero bench on device buffers (cuda_ipc on one GPU), 2 and 4 processes, next to nothing but
# itself: gpu-check's rows below carry the copy baselines measured in the same run.
for n in 2 4; do
    echo "== ringzero bench all-reduce --device cuda -n $n"
    target/release/ringzero bench all-reduce --device cuda -n "$n" -b 1M -e 256M -f 4 --iters 10 \
        --warmup 3 --json "$out/bench-cuda-n$n.json" | tail -8 || status=1
done
# Host staging (P2P disabled) both ways: kernels on the mapped slots, and explicit copies through
# device scratch (RINGZERO_STAGING=copy). The issue asks to measure both.
for staging in mapped copy; do
    echo "== RINGZERO_P2P_DISABLE=1 RINGZERO_STAGING=$staging ringzero bench all-reduce --device cuda -n 2"
    RINGZERO_P2P_DISABLE=1 RINGZERO_STAGING=$staging target/release/ringzero bench all-reduce \
        --device cuda -n 2 -b 1M -e 256M -f 4 --iters 10 --warmup 3 \
        --json "$out/bench-staging-$staging.json" | tail -8 || status=1
done
target/release/ringzero gpu-check --json "$out/gpu-check.json" || status=1
exit $status
