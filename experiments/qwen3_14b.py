"""Qwen3-14B-Base, the paper's 14B setting (300 steps).

    python -m delta_jax.main --config=experiments/qwen3_14b.py --workdir=runs/qwen3_14b \
        --config.model.path=/path/to/model --config.data.train=/path/to/train.jsonl
"""
from delta_jax.train.recipes import paper_config


def get_config():
    c = paper_config("qwen3-14b", steps=300)
    # On 8 x 80 GB the device-resident DelTA feature cache does not fit beside the old-policy pass
    # (--config.mode=plan); host memory does. Use "device" on larger-memory accelerators.
    c.delta.feature_cache = "host"
    # Beside Qwen3-14B's larger optimizer state a smaller page pool (16 GiB a GPU, 105k tokens)
    # for fewer slots (128, 16 a GPU): rollout and eval phases plan 50 GB of the 60 GB limit.
    c.rollout.max_batch_size = 128
    c.rollout.kv_budget_gb = 16.0
    return c
