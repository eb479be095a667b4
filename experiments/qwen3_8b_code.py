"""Qwen3-8B-Base on code: the paper's DelTA recipe with unit-test rewards (220 steps).

    python -m delta_jax.main --config=experiments/qwen3_8b_code.py --workdir=runs/qwen3_8b_code \
        --config.model.path=/path/to/Qwen3-8B-Base --config.data.train=/path/to/taco_train.jsonl \
        --config.data.eval=../shared/data/humaneval.jsonl

Training data: any code layout data/records.py reads (TACO / APPS stdin-stdout or call-based,
CodeContests, MBPP-style assert lists, HumanEval-style); the record's answer is its unit-test
spec. Rewards: RewardScorer(name="code"): the last ```python block of a response runs against the
tests in the local sandbox (rl/sandbox.py; needs user namespaces, or
--config.rewards.code_sandbox=sandbox_fusion --config.rewards.code_sandbox_url=http://host:8080),
1 when every test passes. Evaluation: pass@1 / pass@k on HumanEval.
"""
from delta_jax.train.recipes import paper_config


def get_config():
    c = paper_config("qwen3-8b", steps=220)
    c.data.template = "code"            # chat layout with the one-```python-block instruction
    c.rewards.name = "code"
    c.rewards.num_workers = 16          # sandbox workers (one program each at a time)
    c.rewards.timeout_s = 10.0          # wall-clock seconds per program, all its tests
    # rewards.code_* keep their defaults (train/config.py): the local sandbox with isolation,
    # 1 GB and 8 processes per program, all-or-nothing rewards.
    # Code answers are shorter than math chains of thought.
    c.rollout.max_new_tokens = 8192
    c.rewards.overlong_buffer = 2048
    c.eval.k = 16
    c.eval.pass_k = "1,4,16"
    c.eval.max_new_tokens = 8192
    return c
