#!/usr/bin/env bash
# The GPT trained on the GPU (#42): `ringzero train --device cuda` on 2 and 4 processes sharing
# the one GPU, stages 0-3, fp32 and bf16; each run prints loss, tokens/s, rank 0's engine memory
# and its GPU memory by the driver beside the prediction. Run without MPS: under it the driver
# gives no figure per process. Needs a `ringzero` built by scripts/build-gpu.sh.
#
#     BIN=.gpubin bash scripts/gpu-train.sh
#
# Every run's whole output goes to $OUT/train.txt (or /tmp); the exit status is 1 if any failed.
#
#     BIN=.gpubin bash scripts/gpu-train.sh offload
#
# runs #39's comparison instead: a GPT of about 1 B parameters on 2 processes, stage 2, under
# Hugging Face's published ds_config_zero2.json (optimizer offloaded to the CPU) and the same
# config with offload_optimizer on "none", then with the delayed parameter update; then stage 3
# the same way under ds_config_zero3.json; each prints its last step's wall time, the CPU step,
# the device's wait and the bytes each way (about 40 s a run on an H100).
set -uo pipefail
cd "$(dirname "$0")/.."
B=${BIN:-.gpubin}/ringzero
out=${OUT:-/tmp}
. scripts/nvrtc-path.sh
status=0
predict() {  # config, then mem arguments: the footprint `ringzero mem` predicts before a run
    local cfg=$1; shift
    echo "== mem $*: $cfg" | tee -a "$out/train.txt"
    "$B" mem --device cuda --config "$cfg" "$@" 2>&1 | tee -a "$out/train.txt" | grep -E "^ +[0-3] |error"
}
run() {  # label, limit, then train arguments
    local label=$1 limit=$2; shift 2
    echo "== train $label"
    local t0=$SECONDS
    echo "== train $label: $*" >>"$out/train.txt"
    timeout -k 5 "$limit" "$B" train --device cuda "$@" 2>&1 | tee -a "$out/train.txt" | \
        grep -E "^GPT|^step +0 |tokens/s|last step|GPU memory|communication buffers|^loss|error|Error|panicked" 
    local rc=${PIPESTATUS[0]}
    echo "== train $label: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}
if [ "${1:-}" = offload ]; then
    # 1.0 B parameters (20 blocks of width 2048); per process about 15 GB of candle's (variables,
    # gradients, activations at batch 8 × 128) and 10 GB of the engine's without offload.
    L="--dim 2048 --heads 16 --layers 20 --ctx 128 --batch 8 --steps 6 --log-every 1 --threshold 100"
    hf=tests/fixtures/deepspeed/hf-ds_config_zero2.json
    sed 's/"device": "cpu"/"device": "none"/' "$hf" >"$out/zero2-none.json"
    # The corpus's vocabulary is 32 characters.
    G="--gpt 20,2048,16,128,32 --dp 2 --batch 8"
    predict "$out/zero2-none.json" $G --stage 2
    predict "$hf" $G --stage 2
    run offload-none-n2 180 -n 2 --config "$out/zero2-none.json" $L
    run offload-cpu-n2 180 -n 2 --config "$hf" $L
    run offload-cpu-dpu-n2 180 -n 2 --config "$hf" --delayed-update-after 1 $L
    # Stage 3 under ds_config_zero3.json (fp16; optimizer and parameters on the CPU), the same
    # on the device, and with the delayed update.
    # fp16's dynamic loss scale starts at 2^16 and skips the first steps on overflow: 8 steps
    # leave the last ones real, so the delayed update's last step has an update in flight.
    L="${L/--steps 6/--steps 8}"
    hf3=tests/fixtures/deepspeed/hf-ds_config_zero3.json
    sed 's/"device": "cpu"/"device": "none"/g' "$hf3" >"$out/zero3-none.json"
    predict "$out/zero3-none.json" $G --stage 3
    predict "$hf3" $G --stage 3
    run offload3-none-n2 180 -n 2 --config "$out/zero3-none.json" $L
    run offload3-cpu-n2 180 -n 2 --config "$hf3" $L
    run offload3-cpu-dpu-n2 180 -n 2 --config "$hf3" --delayed-update-after 1 $L
    exit $status
fi
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
