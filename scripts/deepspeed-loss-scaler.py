#!/usr/bin/env python3
"""Writes tests/fixtures/deepspeed-loss-scaler.json: random fp16 dynamic loss-scaling settings
(DeepSpeed's `fp16` keys: initial_scale_power, loss_scale_window, hysteresis,
consecutive_hysteresis, min_loss_scale) and random overflow patterns, each with the scale
DeepSpeed's ZeRO loss scaler (`DynamicLossScaler`, which ZeRO stages 1-3 make from those keys)
holds after every step, and the step at which it stops the run (an overflow with the scale
already at min_loss_scale). The test `scaler::tests::dynamic_scaling_matches_deepspeeds_zero_
scaler` (zero/src/scaler.rs) drives ringzero's scaler through the same patterns.

    python3 -m venv /tmp/hfv && /tmp/hfv/bin/pip install torch deepspeed ninja
    PATH=/tmp/hfv/bin:$PATH python scripts/deepspeed-loss-scaler.py [SEED] [N] [STEPS]
"""
import logging
import os
import random
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=os.environ.get("MASTER_PORT", "29535"))
import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler  # noqa: E402
from deepspeed.runtime.precision_config import DeepSpeedFP16Config  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import fixture_json  # noqa: E402


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 60
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    rng = random.Random(seed)
    entries = []
    for _ in range(n):
        fp16 = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": rng.choice([2, 4, 16]),
            "loss_scale_window": rng.choice([1, 2, 3, 5, 10]),
            "hysteresis": rng.choice([1, 2, 3]),
            "consecutive_hysteresis": rng.random() < 0.5,
            "min_loss_scale": rng.choice([1, 2, 4]),
        }
        # As the ZeRO optimizers make it from the config's `fp16` section.
        args = DeepSpeedFP16Config(**fp16).dynamic_loss_scale_args()
        scaler = CreateLossScaler(dtype=torch.half, static_loss_scale=0, dynamic_scaling=True,
                                  dynamic_loss_args=args)
        p = rng.choice([0.05, 0.2, 0.5, 0.8])
        overflows, scales, stopped_at = [], [], None
        for s in range(steps):
            overflow = rng.random() < p
            overflows.append(overflow)
            try:
                scaler.update_scale(overflow)
            except Exception:  # noqa: BLE001 -- DeepSpeed raises a bare Exception here
                stopped_at = s
                break
            scales.append(float(scaler.cur_scale))
        entries.append({"fp16": fp16, "overflows": overflows, "scales": scales,
                        "stopped_at": stopped_at})
    made_by = (f"scripts/deepspeed-loss-scaler.py {seed} {n} {steps}: DeepSpeed "
               f"{deepspeed.__version__}, torch {torch.__version__}")
    path = "tests/fixtures/deepspeed-loss-scaler.json"
    fixture_json.write(path, made_by, entries)
    print(f"{path}: {n} patterns of up to {steps} steps")


if __name__ == "__main__":
    main()
