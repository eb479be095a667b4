"""Qwen3-8B-Base, the paper's 8B setting (220 steps).

    python -m delta_jax.main --config=experiments/qwen3_8b.py --workdir=runs/qwen3_8b \
        --config.model.path=/path/to/model --config.data.train=/path/to/train.jsonl
"""
from delta_jax.train.recipes import paper_config


def get_config():
    c = paper_config("qwen3-8b", steps=220)
    # On 8 x 80 GB the device-resident DelTA feature cache (43 GB a GPU) beside the old-policy
    # pass plans 65.4 GB a GPU, over jax's default allocator limit there (0.75 x 80 GB;
    # --config.mode=plan --config.plan.target=cuda); host memory plans 23.8 GB. Use "device" on
    # larger-memory accelerators (a v5p-64 plans 49.7 GB of 95) or with XLA_CLIENT_MEM_FRACTION=0.9.
    c.delta.feature_cache = "host"
    return c
