"""Qwen3-14B-Base, the paper's 14B setting (300 steps).

    python -m delta_jax.main --config=experiments/qwen3_14b.py --workdir=runs/qwen3_14b \
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
    return load_base().paper_config("qwen3-14b", steps=300)
