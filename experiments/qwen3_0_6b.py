"""Qwen3-0.6B(-Base): the paper's recipe scaled down to a small model and batch
(recipes.small_model_config).

    python -m delta_jax.main --config=experiments/qwen3_0_6b.py --workdir=runs/qwen3_0_6b \
        --config.model.path=/path/to/model --config.data.train=/path/to/train.jsonl
"""
from delta_jax.train.recipes import small_model_config


def get_config():
    return small_model_config("qwen3-0.6b", steps=200)
