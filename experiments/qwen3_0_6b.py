"""Qwen3-0.6B(-Base): the paper's recipe scaled down to a small model and batch.

    python -m delta_jax.main --config=experiments/qwen3_0_6b.py --workdir=runs/qwen3_0_6b \
        --config.model.path=/path/to/model --config.data.train=/path/to/train.jsonl
"""
from delta_jax.train.recipes import paper_config


def get_config():
    c = paper_config("qwen3-0.6b", steps=200)
    c.rollout.batch_prompts = 32
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 4096
    c.rewards.overlong_buffer = 1024
    c.rl.mini_batch_prompts = 8
    c.rl.micro_batch_size = 8
    c.optim.lr = 1e-6
    c.eval.max_new_tokens = 8192
    return c
