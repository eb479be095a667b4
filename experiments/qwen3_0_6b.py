"""Qwen3-0.6B(-Base): the paper's recipe scaled down to a small model and batch.

    python -m delta_jax.main --config=experiments/qwen3_0_6b.py --workdir=runs/qwen3_0_6b \
        --config.model.path=/path/to/model --config.data.train=/path/to/train.jsonl
"""
import importlib.util
import pathlib


def load_base():
    path = pathlib.Path(__file__).with_name("base.py")
    spec = importlib.util.spec_from_file_location("delta_jax_experiments_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config():
    c = load_base().paper_config("qwen3-0.6b", steps=200)
    c.rollout.batch_prompts = 32
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 4096
    c.rewards.overlong_buffer = 1024
    c.rl.mini_batch_prompts = 8
    c.rl.micro_batch_size = 8
    c.optim.lr = 1e-6
    c.eval.max_new_tokens = 8192
    return c
