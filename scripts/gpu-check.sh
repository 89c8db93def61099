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
target/release/ringzero gpu-check --json "$out/gpu-check.json" || status=1
exit $status
