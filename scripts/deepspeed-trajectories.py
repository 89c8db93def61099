#!/usr/bin/env python3
"""Writes tests/fixtures/deepspeed-trajectories.json: random DeepSpeed configs (ZeRO stage 0, 1
or 2 in fp32; Adam, AdamW or SGD with their parameters; gradient clipping; gradient
accumulation; a scheduler or none), each trained by DeepSpeed's own engine
(`deepspeed.initialize` on the CPU, one process) for a few optimizer steps on two parameters
whose gradients are given: the loss is sum(w * gw) + sum(b * gb), so each micro-step's gradient
is exactly the stored one. The fixture holds the initial values, every micro-step's gradients
and the parameters after every optimizer step; the test
`training_matches_deepspeeds_engine_step_by_step` (tests/deepspeed_configs.rs) runs ringzero's
engine on the same config and gradients and compares.

    python3 -m venv /tmp/hfv && /tmp/hfv/bin/pip install torch deepspeed ninja
    PATH=/tmp/hfv/bin:$PATH python scripts/deepspeed-trajectories.py [SEED] [N] [STEPS]

Adam and AdamW run as torch's (`torch_adam`, on the CPU); their weight decay is always given,
since torch's AdamW and DeepSpeed's fused one (which ringzero follows) default it differently.
"""
import logging
import os
import random
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=os.environ.get("MASTER_PORT", "29534"))
import deepspeed  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from importlib import import_module  # noqa: E402

import fixture_json  # noqa: E402

schedules = import_module("deepspeed-schedules")

SHAPES = {"w": 24, "b": 5}


class Given(torch.nn.Module):
    """Two parameters whose gradient is what forward is given."""

    def __init__(self, init):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(init["w"], dtype=torch.float32))
        self.b = torch.nn.Parameter(torch.tensor(init["b"], dtype=torch.float32))

    def forward(self, gw, gb):
        return (self.w * gw).sum() + (self.b * gb).sum()


def f32_list(t):
    return [float(x) for x in t.detach().to(torch.float32).reshape(-1)]


def optimizer(rng):
    lr = round(10 ** rng.uniform(-3, -1), 6)
    ty = rng.choice(["Adam", "AdamW", "SGD"])
    if ty == "SGD":
        p = {"lr": lr, "momentum": rng.choice([0.0, 0.9])}
        if p["momentum"] and rng.random() < 0.5:
            p["nesterov"] = True
        if rng.random() < 0.5:
            p["weight_decay"] = rng.choice([0.0, 0.01, 0.1])
        return {"type": ty, "params": p}
    p = {"lr": lr, "weight_decay": rng.choice([0.0, 0.01, 0.1]), "torch_adam": True}
    if rng.random() < 0.5:
        p["betas"] = [rng.choice([0.8, 0.9]), rng.choice([0.99, 0.999])]
    if rng.random() < 0.5:
        p["eps"] = rng.choice([1e-8, 1e-6])
    if ty == "Adam" and rng.random() < 0.5:
        p["adam_w_mode"] = rng.random() < 0.5
    return {"type": ty, "params": p}


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    deepspeed.utils.logger.setLevel(logging.ERROR)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    entries = []
    for i in range(n):
        gas = rng.choice([1, 1, 2, 3])
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": gas,
            "optimizer": optimizer(rng),
            "zero_optimization": {"stage": rng.choice([0, 1, 2])},
        }
        if rng.random() < 0.3:
            # The accumulation as DeepSpeed derives it: train batch / (micro batch × world).
            del config["gradient_accumulation_steps"]
            config["train_batch_size"] = gas
        if config["zero_optimization"]["stage"] > 0:
            # DeepSpeed's ZeRO wants this for torch's optimizers, which it calls untested.
            config["zero_allow_untested_optimizer"] = True
        if rng.random() < 0.5:
            config["gradient_clipping"] = rng.choice([0.1, 1.0, 5.0])
        if rng.random() < 0.5:
            ty = rng.choice(schedules.TYPES)
            config["scheduler"] = schedules.scheduler(rng, ty, steps)
            # Rates a model trains at: at rates near 10 (which the schedule fixture also
            # covers) Adam's weights move by several units a step, and rounding compounds.
            p = config["scheduler"]["params"]
            if "cycle_max_lr" in p:
                p["cycle_max_lr"] = min(p["cycle_max_lr"], 0.1)
                p["cycle_min_lr"] = min(p["cycle_min_lr"], p["cycle_max_lr"])
            if "lr_range_test_min_lr" in p:
                p["lr_range_test_min_lr"] = min(p["lr_range_test_min_lr"], 0.005)
        init = {k: f32_list(torch.randn(s, generator=gen)) for k, s in SHAPES.items()}
        model = Given(init)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config)
        grads, params = [], []
        for _ in range(steps):
            for _ in range(gas):
                g = {k: f32_list(torch.randn(s, generator=gen) * rng.choice([0.01, 1.0, 10.0]))
                     for k, s in SHAPES.items()}
                grads.append(g)
                engine.backward(engine(torch.tensor(g["w"]), torch.tensor(g["b"])))
                engine.step()
            params.append({"w": f32_list(model.w), "b": f32_list(model.b)})
        config["optimizer"]["params"].pop("torch_adam", None)
        entries.append({"config": config, "init": init, "grads": grads, "params": params})
    made_by = (f"scripts/deepspeed-trajectories.py {seed} {n} {steps}: DeepSpeed "
               f"{deepspeed.__version__}, torch {torch.__version__}")
    path = "tests/fixtures/deepspeed-trajectories.json"
    fixture_json.write(path, made_by, entries)
    print(f"{path}: {n} runs of {steps} optimizer steps")


if __name__ == "__main__":
    main()
