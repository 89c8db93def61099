#!/usr/bin/env python3
"""Writes tests/fixtures/hf-config-counts.json: small random configs of every family
`ringzero mem --params` counts from a config.json (tools/src/cmd/hf_config.rs), each with the
parameter count `transformers` gives the model it builds from that config, on PyTorch's meta
device (nothing allocated). The switches a config may set -- biases, tied head, head_dim,
key/value heads, left out or given -- are drawn at random, so the fixture holds what each
family's modeling code reads and ignores. The test `cmd::hf_config` checks ringzero's count of
every entry against it.

    python3 -m venv /tmp/hfv && /tmp/hfv/bin/pip install torch transformers
    /tmp/hfv/bin/python scripts/hf-config-counts.py [SEED] [N]
"""
import os
import random
import sys
import warnings

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(__file__))
import fixture_json  # noqa: E402

FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3",
            "gpt2", "gpt_neox"]


def config(rng, family):
    heads = rng.choice([2, 4, 8])
    dim = heads * rng.choice([8, 16])
    # pad_token_id 0: some families' default padding index lies past a small vocabulary.
    c = {"model_type": family, "pad_token_id": 0}
    if family == "gpt2":
        c.update(n_embd=dim, n_head=heads, n_layer=rng.randint(1, 3),
                 n_positions=rng.choice([16, 32]), vocab_size=rng.randint(50, 200))
        if rng.random() < 0.5:
            c["n_inner"] = rng.choice([48, 64, 100])
    else:
        c.update(hidden_size=dim, num_attention_heads=heads,
                 num_hidden_layers=rng.randint(1, 3), vocab_size=rng.randint(50, 200),
                 intermediate_size=rng.choice([40, 64, 96]))
        if family != "gpt_neox":
            kv = rng.choice([h for h in [1, 2, heads] if heads % h == 0])
            if rng.random() < 0.8:
                c["num_key_value_heads"] = kv
            if rng.random() < 0.5:
                c["head_dim"] = rng.choice([8, 12, 16])
            if rng.random() < 0.5:
                c["mlp_bias"] = rng.random() < 0.5
            if family == "mixtral":
                c["num_local_experts"] = rng.choice([2, 4])
        if rng.random() < 0.5:
            c["attention_bias"] = rng.random() < 0.5
    if rng.random() < 0.6:
        c["tie_word_embeddings"] = rng.random() < 0.5
    return c


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    rng = random.Random(seed)
    entries = []
    for i in range(n):
        c = config(rng, FAMILIES[i % len(FAMILIES)])
        cfg = AutoConfig.for_model(**c)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        entries.append({"config": c, "params": sum(p.numel() for p in model.parameters())})
    made_by = (f"scripts/hf-config-counts.py {seed} {n}: transformers "
               f"{transformers.__version__}, torch {torch.__version__}")
    path = "tests/fixtures/hf-config-counts.json"
    fixture_json.write(path, made_by, entries)
    print(f"{path}: {n} configs")


if __name__ == "__main__":
    main()
