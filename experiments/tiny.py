"""The default job: a tiny Qwen3-shaped model from random init on the built-in synthetic
arithmetic task (data and tokenizer generated into the workdir, no downloads): a short SFT warm
start, eval, DelTA RL, eval.

    python -m delta_jax.main --config=experiments/tiny.py --workdir=runs/tiny
"""
from delta_jax.train.config import default_config


def get_config():
    c = default_config()
    c.seed = 0
    c.method = "delta"
    c.model.random_init = True
    c.model.preset = "tiny"
    c.model.hidden_size = 128
    c.model.intermediate_size = 384
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 32
    c.model.logprob_chunk = 64
    c.tokenizer.path = "synthetic"
    c.data.train = "synthetic"
    c.data.eval = "synthetic"
    c.data.max_prompt_len = 96
    c.data.synthetic_train = 4000
    c.data.synthetic_test = 64
    c.data.synthetic_levels = "1,2"
    c.rollout.batch_prompts = 16
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 48
    c.rollout.max_batch_size = 128
    c.rewards.num_workers = 2
    c.rewards.overlong_buffer = 8
    c.rl.mini_batch_prompts = 8
    c.rl.micro_batch_size = 0
    c.optim.lr = 2e-5
    c.optim.weight_decay = 0.0
    c.train.steps = 30
    c.train.save_every = 10
    c.train.eval_every = 0
    c.train.keep = 2
    c.sft.steps = 300
    c.sft.batch_size = 32
    c.sft.lr = 2e-3
    c.sft.max_len = 128
    c.eval.k = 4
    c.eval.pass_k = "1,4"
    c.eval.temperature = 1.0
    c.eval.top_p = 1.0
    c.eval.max_new_tokens = 48
    c.eval.limit = 64
    return c
