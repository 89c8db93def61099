#!/usr/bin/env bash
# The GPT trained on the GPU (#42): `ringzero train --device cuda` on 2 and 4 processes sharing
# the one GPU, stages 0-3, fp32 and bf16; each run prints loss, tokens/s, rank 0's engine memory
# and its GPU memory by the driver beside the prediction. Run without MPS: under it the driver
# gives no figure per process. Needs a `ringzero` built by scripts/build-gpu.sh.
#
#     BIN=.gpubin bash scripts/gpu-train.sh
#
# Every run's whole output goes to $OUT/train.txt (or /tmp); the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${BIN:-.gpubin}/ringzero
out=${OUT:-/tmp}
. scripts/nvrtc-path.sh
status=0
run() {  # label, limit, then train arguments
    local label=$1 limit=$2; shift 2
    echo "== train $label"
    local t0=$SECONDS
    echo "== train $label: $*" >>"$out/train.txt"
    timeout -k 5 "$limit" "$B" train --device cuda "$@" 2>&1 | tee -a "$out/train.txt" | \
        grep -E "^GPT|^step +0 |tokens/s|GPU memory|^loss|error|Error|panicked" 
    local rc=${PIPESTATUS[0]}
    echo "== train $label: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}
# A model large enough that the GPU's share shows: width 256, 4 blocks, context 128.
M="--dim 256 --heads 8 --layers 4 --ctx 128 --batch 16"
# The default shape's whole run, as the README's example trains it on the CPU: the loss falls
# below its threshold.
run default-n2 60 -n 2 --stage 2
for s in 0 1 2 3; do
    run stage$s-n2 40 -n 2 --stage $s $M --steps 40 --threshold 3.2 --log-every 10
done
run stage3-n4 50 -n 4 --stage 3 $M --steps 40 --threshold 3.2 --log-every 10
run stage2-bf16-n4 50 -n 4 --stage 2 --precision bf16 $M --steps 40 --threshold 3.2 --log-every 10
exit $status
