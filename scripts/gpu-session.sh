#!/usr/bin/env bash
# The GPU check for a short lease: one device call of at most ten minutes, with the most needed
# checks first and each later step skipped when what is left of the budget cannot hold it.
# scripts/gpu-check.sh is the whole check (both ways of every bench, with and without MPS); this
# is its order of importance for a session whose device time is a quarter of an hour.
#
#     GPU_BUDGET_S=540 BIN=target/release bash scripts/gpu-session.sh [staging]
#
# With `staging` it runs a follow-up instead: host staging on 3 ranks both ways (what
# RINGZERO_STAGING=auto's threshold of 2 copying ranks per GPU has not measured), the whole
# gpu-check, then host staging on 2 and 4 ranks up to 1 GiB and across slice sizes, each bench
# printing the kernel-on-mapped-memory rate beside the copy engines' both-ways bound.
#
# BIN holds `ringzero` and the kernels' `cuda-*` test binary, built on an x86-64 machine:
#     cargo build --release && cargo test --release --no-run -p ringzero-kernels --test cuda
# or, with candle's CUDA backend for scripts/gpu-train.sh, `bash scripts/build-gpu.sh` (into
# .gpubin/, `ringzero` as ringzero.xz, which this script restores): then the training runs come
# first (step 0 below).
# Everything goes to $OUT (or /tmp): log lines with the seconds each step took, gpu-check.json,
# diag.json, and the benches' JSON in benches.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
budget=${GPU_BUDGET_S:-540}
BIN=${BIN:-target/release}
B=$BIN/ringzero
out=${OUT:-/tmp}
mkdir -p "$out/bench"
. scripts/nvrtc-path.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
status=0
# step LABEL LIMIT_S CMD...: runs CMD under `timeout LIMIT_S` if that much budget is left.
step() {
    local label=$1 limit=$2; shift 2
    local left=$((budget - SECONDS))
    if [ "$left" -lt "$limit" ]; then
        echo "== SKIP $label: ${left} s of the budget left, it may take ${limit} s"
        return 0
    fi
    echo "== $label (at ${SECONDS} s)"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@"
    local rc=$?
    echo "== $label: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}
bench() {  # label, limit, then env assignments and bench arguments
    local label=$1 limit=$2; shift 2
    step "bench $label" "$limit" env "$@" --json "$out/bench/$label.json"
}
# build-gpu.sh's binary travels compressed; a carried folder replaces the machine's copy on
# every call, so it is restored here each time.
if [ -f "$BIN/ringzero.xz" ] && [ ! -x "$B" ]; then
    xz -dk "$BIN/ringzero.xz" && chmod +x "$B"
fi
for t in "$BIN"/cuda-* "$BIN"/deps/cuda-*; do
    [ -x "$t" ] && [ -f "$t" ] || continue
    step "kernel tests $t" 60 "$t" --nocapture
done
# 0. With candle's CUDA backend in the binary (build-gpu.sh's, the one that travels as
# ringzero.xz): the GPT trained on the GPU (#42), then the offload comparison under a 1 B GPT
# (#39), before MPS starts (under MPS the driver gives no memory figure per process). About
# 120 s and 240 s on an H100.
if [ "${1:-}" != staging ] && [ -f "$BIN/ringzero.xz" ]; then
    step "gpu-train" 240 env BIN="$BIN" OUT="$out" bash scripts/gpu-train.sh
    step "gpu-train offload" 320 env BIN="$BIN" OUT="$out" bash scripts/gpu-train.sh offload
fi
export CUDA_MPS_PIPE_DIRECTORY=/tmp/ringzero-mps CUDA_MPS_LOG_DIRECTORY=/tmp/ringzero-mps-log
mps=0
if command -v nvidia-cuda-mps-control >/dev/null && [ ! -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && mps=1 && echo "== MPS daemon started"
fi
[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || {
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "== no MPS: ranks time-slice the GPU"
}
A="all-reduce --device cuda --iters 10 --warmup 3"
if [ "${1:-}" = staging ]; then
    M="$B bench $A -b 64M -e 256M"
    bench staging-n3 60 RINGZERO_P2P_DISABLE=1 $M -n 3
    bench staging-copy-n3 60 RINGZERO_P2P_DISABLE=1 RINGZERO_STAGING=copy $M -n 3
    step "gpu-check" 300 $B gpu-check --json "$out/gpu-check.json"
    S="$B bench $A -b 16M -e 1G"
    bench staging-1G-n2 60 RINGZERO_P2P_DISABLE=1 $S -n 2
    # 4 ranks up to 1 GiB take about a minute (57 s on the H200, mapped).
    bench staging-1G-n4 90 RINGZERO_P2P_DISABLE=1 $S -n 4
    bench staging-32M-n2 60 RINGZERO_P2P_DISABLE=1 RINGZERO_DEVICE_SLICE_BYTES=32M $M -n 2
    bench staging-nopairs-n2 60 RINGZERO_P2P_DISABLE=1 RINGZERO_DEVICE_COPY_PAIRS=off $M -n 2
    bench staging-8slots-n2 60 RINGZERO_P2P_DISABLE=1 RINGZERO_SLOTS=8 $M -n 2
else
# 1. Every kernel, then every collective at small counts (1, 1023, 4099): exactness only, about
# 60 s. Small calls end quickly, so work that is not ordered behind what it depends on shows
# here first (the H200 run of 2026-11-26 found two such races this way).
step "gpu-check --quick" 150 $B gpu-check --quick --no-bench --json "$out/gpu-check-quick.json"
# 1b. ZeRO-Offload on the GPU (#39): a 1B-parameter engine on 2 ranks, stage 2, its optimizer
# state on the device, in page-locked host memory and on NVMe (/tmp): step time and its ratio
# to the device's (the target: cpu at most 1.3x), the wait for gradients, the CPU step, PCIe and
# NVMe bytes, bytes by tier. Then stage 3 with ZeRO-Infinity (the shards on NVMe too).
step "offload-bench stage 2" 200 sh -c "$B offload-bench -n 2 --params 1B --stage 2 --steps 2 | tee $out/offload-stage2.txt"
step "offload-bench stage 3" 200 sh -c "$B offload-bench -n 2 --params 1B --stage 3 --steps 2 --infinity | tee $out/offload-stage3.txt"
# 2. Every kernel and every collective run at full counts (exactness, bandwidth rows, killed
# ranks): about 200 s on an H100 or H200; what follows measures, this checks.
step "gpu-check" 300 $B gpu-check --json "$out/gpu-check.json"
# 3. Host staging on 2 ranks against its bound: explicit copies (RINGZERO_STAGING=auto's pick
# for 2 ranks of one GPU) with the copy pair on and off, and mapped, in one MPS session.
bench staging-n2 60 RINGZERO_P2P_DISABLE=1 $B bench $A -b 64M -e 256M -n 2
bench staging-nopairs-n2 60 RINGZERO_P2P_DISABLE=1 RINGZERO_DEVICE_COPY_PAIRS=off \
    $B bench $A -b 64M -e 256M -n 2
# Kernels on the mapped slots (auto's pick for more than 2 ranks) against the copy lanes above.
bench staging-mapped-n2 60 RINGZERO_P2P_DISABLE=1 RINGZERO_STAGING=mapped $B bench $A -b 64M -e 256M -n 2
# 4. What has never run on a GPU beyond gpu-check: the all-to-all pull against the ring, the
# bench's device baseline and bound lines on cuda_ipc, staging on 4 ranks, diag.
A2A="all-to-all --device cuda -b 16M -e 256M -f 4 --iters 10 --warmup 3 -n 4"
bench a2a-n4 60 $B bench $A2A
bench a2a-ring-n4 60 RINGZERO_DEVICE_ALGO=ring $B bench $A2A
bench cuda_ipc-n2 60 $B bench $A -b 4M -e 256M -n 2
bench cuda_ipc-n4 60 $B bench $A -b 4M -e 256M -n 4
bench staging-n4 60 RINGZERO_P2P_DISABLE=1 $B bench $A -b 64M -e 256M -n 4
# Auto maps on 4 ranks of one GPU; the copy lanes beside it (0.73x on the H200, session 29).
bench staging-copy-n4 60 RINGZERO_P2P_DISABLE=1 RINGZERO_STAGING=copy $B bench $A -b 64M -e 256M -n 4
step "diag --json" 90 sh -c "$B diag --json > $out/diag.json"
fi
[ "$mps" = 1 ] && echo quit | nvidia-cuda-mps-control
tar -C "$out" -czf "$out/benches.tgz" bench && rm -rf "$out/bench"
echo "== done at ${SECONDS} s, status $status"
exit $status
