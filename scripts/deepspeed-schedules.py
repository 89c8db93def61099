#!/usr/bin/env python3
"""Writes tests/fixtures/deepspeed-schedules.json: random `scheduler` sections of every type
DeepSpeed defines (WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest, OneCycle), parameters
given or left out at random, each with the learning rate (and Adam's betas) that DeepSpeed's
own engine runs each optimizer step at: `deepspeed.initialize` on the CPU, one process, a tiny
model, the rates read from the optimizer just before each `engine.step()`. The test
`schedules_match_deepspeeds_engine_step_by_step` (tests/deepspeed_configs.rs) reads each config
with `ZeroConfig::from_json` and checks ringzero's rate at every step against it.

    python3 -m venv /tmp/hfv && /tmp/hfv/bin/pip install torch deepspeed ninja
    PATH=/tmp/hfv/bin:$PATH python scripts/deepspeed-schedules.py [SEED] [N] [STEPS]

(DeepSpeed builds its shared-memory op with ninja and g++ the first time.)
"""
import logging
import os
import random
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
import deepspeed  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import fixture_json  # noqa: E402

TYPES = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest", "OneCycle"]


def maybe(rng, params, key, value, p=0.7):
    if rng.random() < p:
        params[key] = value


def scheduler(rng, ty, steps):
    p = {}
    lr = lambda: round(10 ** rng.uniform(-5, -1), 8)  # noqa: E731
    if ty in ("WarmupLR", "WarmupDecayLR"):
        maybe(rng, p, "warmup_min_lr", rng.choice([0, lr()]))
        maybe(rng, p, "warmup_max_lr", lr())
        maybe(rng, p, "warmup_num_steps", rng.choice([1, 2, 5, 10, 25]), 0.9)
        maybe(rng, p, "warmup_type", rng.choice(["log", "linear"]), 0.5)
        if ty == "WarmupDecayLR":
            p["total_num_steps"] = p.get("warmup_num_steps", 1000) + rng.choice([1, 5, 20, 40])
    elif ty == "WarmupCosineLR":
        w = rng.choice([1, 2, 5, 10])
        p["warmup_num_steps"] = w
        # Now and then a total within the warm-up: DeepSpeed warns, then holds the floor.
        p["total_num_steps"] = max(w, 2) + rng.choice([-1, 0, 1, 5, 10, 30])
        maybe(rng, p, "warmup_min_ratio", rng.choice([0, 0.1, 0.5]))
        maybe(rng, p, "cos_min_ratio", rng.choice([0.0001, 0.1, 0.5]))
        maybe(rng, p, "warmup_type", rng.choice(["log", "linear"]), 0.5)
    elif ty == "LRRangeTest":
        maybe(rng, p, "lr_range_test_min_lr", lr())
        maybe(rng, p, "lr_range_test_step_size", rng.choice([1, 3, 10]))
        maybe(rng, p, "lr_range_test_step_rate", rng.choice([0.5, 1.0, 2.0]))
        maybe(rng, p, "lr_range_test_staircase", rng.choice([True, False]), 0.5)
    else:
        lo = lr()
        p["cycle_min_lr"] = lo
        p["cycle_max_lr"] = round(lo * rng.choice([2, 10, 100]), 10)
        p["cycle_first_step_size"] = rng.choice([2, 5, 10])
        maybe(rng, p, "cycle_second_step_size", rng.choice([0, 3, 8]), 0.5)
        if rng.random() < 0.3:
            p["cycle_first_stair_count"] = rng.choice([1, 2, 3])
            maybe(rng, p, "cycle_second_stair_count", rng.choice([0, 2, 4]), 0.5)
        maybe(rng, p, "decay_lr_rate", rng.choice([0.001, 0.1, 0.5]), 0.5)
        maybe(rng, p, "decay_step_size", rng.choice([1, 4]), 0.5)
        if rng.random() < 0.5:
            p["cycle_momentum"] = True
            maybe(rng, p, "cycle_min_mom", rng.choice([0.8, 0.85]))
            maybe(rng, p, "cycle_max_mom", rng.choice([0.9, 0.95]))
            maybe(rng, p, "decay_mom_rate", rng.choice([0.0, 0.1]), 0.5)
        elif rng.random() < 0.5:
            p["cycle_momentum"] = False
    return {"type": ty, "params": p}


def optimizer(rng):
    """Adam or AdamW (torch's, as `torch_adam` makes DeepSpeed take them), or torch's SGD."""
    lr = round(10 ** rng.uniform(-4, -2), 8)
    ty = rng.choice(["Adam", "AdamW", "AdamW", "SGD"])
    if ty == "SGD":
        return {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}}
    return {"type": ty, "params": {"lr": lr, "torch_adam": True}}


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    deepspeed.utils.logger.setLevel(logging.ERROR)
    rng = random.Random(seed)
    entries = []
    for i in range(n):
        ty = TYPES[i % len(TYPES)]
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": optimizer(rng),
            "scheduler": scheduler(rng, ty, steps),
            "zero_optimization": {"stage": 0},
        }
        model = torch.nn.Linear(2, 1)
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                 config=config)
        lrs, beta1, beta2 = [], [], []
        for _ in range(steps):
            engine.backward(engine(torch.ones(1, 2)).sum())
            group = opt.param_groups[0]
            lrs.append(float(group["lr"]))
            betas = group.get("betas")
            beta1.append(None if betas is None else float(betas[0]))
            beta2.append(None if betas is None else float(betas[1]))
            engine.step()
        config["optimizer"]["params"].pop("torch_adam", None)
        entries.append({"config": config, "lr": lrs, "beta1": beta1, "beta2": beta2})
    made_by = (f"scripts/deepspeed-schedules.py {seed} {n} {steps}: DeepSpeed "
               f"{deepspeed.__version__}, torch {torch.__version__}")
    path = "tests/fixtures/deepspeed-schedules.json"
    fixture_json.write(path, made_by, entries)
    print(f"{path}: {n} schedules of {steps} steps")


if __name__ == "__main__":
    main()
