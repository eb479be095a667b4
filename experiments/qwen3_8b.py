"""Qwen3-8B-Base, the paper's 8B setting (220 steps).

    python -m delta_jax.main --config=experiments/qwen3_8b.py --workdir=runs/qwen3_8b \
        --config.model.path=/path/to/model --config.data.train=/path/to/train.jsonl
"""
from delta_jax.train.recipes import paper_config


def get_config():
    return paper_config("qwen3-8b", steps=220)
