"""Shared set-up of the tests that run the real RL trainer on a tiny model (not a test module).

    from tests.rl_fixtures import build_scored_run, initial_state, tiny_rl_config

tests/ is a package and pytest.ini puts the repository root on sys.path, so this imports the
same way under any pytest import mode and from a plain `python` started in the root.

tiny_rl_config: default_config() shrunk to a random-init 2-layer width-32 model (GQA 2/1 heads)
on the built-in synthetic task (64 train / 4 test problems, level 1, prompts <= 32 tokens), one
RL step of 4 prompts x 4 samples x 8 new tokens and one update (mini-batch = the whole rollout),
lr 1e-3, no progress bar. Each test file passes its own differences as per-section overrides.
"""
import gc
import os

import jax
import numpy as np

from delta_jax import sharding
from delta_jax.train import run as run_lib
from delta_jax.train.config import default_config, validate_config
from delta_jax.train.state import init_train_state

def device_bytes(tree, device=None) -> int:
    """Bytes of `tree`'s arrays held on `device` (default: this process's first device), from
    the placed shards themselves."""
    device = jax.local_devices()[0] if device is None else device
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
               for shard in getattr(leaf, "addressable_shards", []) if shard.device == device)


def live_device_bytes(device, memory_kind: str | None = None) -> int:
    """The bytes of the distinct buffers on `device` (in `memory_kind` alone where given:
    "pinned_host") that live arrays hold (gc first): arrays that share a buffer (a checkpoint
    save's views of the state's shards) count it once."""
    gc.collect()
    buffers = {}
    for array in jax.live_arrays():
        if array.is_deleted() or (memory_kind and array.sharding.memory_kind != memory_kind):
            continue
        for shard in array.addressable_shards:
            if shard.device == device:
                buffers[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return sum(buffers.values())


# The tiny model's shape (model.* fields), shared with test_main's config file.
TINY_MODEL = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=16, logprob_chunk_tokens=32)

# train.* fields that keep loop.train() to the RL steps (and checkpoints) a test looks at.
LOOP_WITHOUT_EVAL = dict(eval_before=False, eval_after=False, export_final=False)

_BASE = {
    "model": dict(random_init=True, preset="tiny", **TINY_MODEL),
    "tokenizer": dict(path="synthetic"),
    "data": dict(train="synthetic", template="plain", max_prompt_len=32, synthetic_train=64,
                 synthetic_test=4, synthetic_levels="1"),
    "rollout": dict(batch_prompts=4, group_size=4, max_new_tokens=8, max_batch_size=16),
    "rewards": dict(overlong_buffer=4),
    "rl": dict(mini_batch_prompts=4),
    "optim": dict(lr=1e-3),
    "train": dict(steps=1, progress_bar=False),
}


def apply_overrides(cfg, sections):
    """Sets cfg[section][field] = value for {section: {field: value}}; a section or field the
    config does not have is a KeyError naming it (a typo must not pass silently)."""
    for section, fields in sections.items():
        if section not in cfg:
            raise KeyError(f"config has no section {section!r}")
        for field, value in fields.items():
            if field not in cfg[section]:
                raise KeyError(f"config has no field {section}.{field}")
            cfg[section][field] = value
    return cfg


def tiny_rl_config(method="delta", **sections):
    """The validated tiny RL config (see the module docstring) for `method`, with
    sections = {section: {field: value}} applied over it, e.g.
    tiny_rl_config("dapo", rl=dict(max_nonfinite=1), train=dict(steps=4))."""
    c = default_config()
    c.method = method
    apply_overrides(c, _BASE)
    apply_overrides(c, sections)
    return validate_config(c)


class TextLengthScorer:
    """Stand-in for rl.rewards.RewardScorer: reward 1 for an even-length response text.

    Deterministic and instant, and groups of a random-init policy get reward variance, so the
    RL update is not trivially zero (the real math grader is tested in test_rewards.py)."""

    def score(self, texts, golds, response_lengths=None, truncated=None, problems=None,
              data_sources=None, extra_infos=None, response_ids=None, trainer_state=None,
              solutions=None, columns=None):
        rewards = np.asarray([float(len(t) % 2 == 0) for t in texts], np.float32)
        return rewards, {"accuracy": rewards, "num_timeouts": 0, "num_no_box": len(texts),
                         "num_errors": 0}

    def close(self):
        pass


def single_device_mesh():
    """A (1, 1, 1) mesh on device 0 (the tests see 8 simulated devices)."""
    return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])


def build_scored_run(cfg, workdir, mesh=None):
    """run.build_run without the math grader, scored by TextLengthScorer instead, on `mesh`
    (default: single_device_mesh()). The caller closes it."""
    run = run_lib.build_run(cfg, str(workdir), need_scorer=False,
                            mesh=single_device_mesh() if mesh is None else mesh)
    run.scorer = TextLengthScorer()
    return run


def initial_state(run):
    """The run's initial TrainState (its initial parameters + fresh optimizer state), placed on
    the run's mesh."""
    return run_lib.place_state(run, init_train_state(run.take_initial_params(), run.optimizer))


PROGRAMS = ("old_pass", "ref_pass", "hidden_pass", "topk_proxy_pass", "train_step")


def count_calls(run, programs=PROGRAMS) -> dict:
    """Wraps the run's jitted programs (those that exist) so that every call is counted; returns
    the live counts {program name: calls} (a program never called has no entry)."""
    counts = {}
    for name in programs:
        fn = getattr(run, name)
        if fn is None:
            continue

        def counted(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*args, **kwargs)
        setattr(run, name, counted)
    return counts


class StepRecorder:
    """A loop.train step hook that keeps host copies of what each RL step trained on:
    batches[step] (the train batch, with old_logp and token_weights) and params_after[step]."""

    def __init__(self):
        self.batches, self.params_after = {}, {}

    def __call__(self, run, step, out):
        self.batches[step] = jax.device_get(out.batch)
        self.params_after[step] = jax.device_get(out.state.params)


def tree_max_abs_diff(a, b):
    """max |a - b| over all leaves of two trees with the same number of leaves; NaN if any
    difference is NaN (so an equality or a "moved" check cannot pass on NaN)."""
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(leaves_a) != len(leaves_b):
        raise ValueError(f"trees differ: {len(leaves_a)} vs {len(leaves_b)} leaves")
    return float(np.max([np.max(np.abs(np.asarray(x) - np.asarray(y)))
                         for x, y in zip(leaves_a, leaves_b)]))


def tree_max_relative_change(a, b, origin):
    """The largest, over the leaves of three trees with the same structure, of ||a - b|| /
    ||b - origin|| (float64 L2 norms of the whole leaf): how far `a` ends from `b` relative to how
    far `b` moved from `origin`. NaN if a difference is NaN; inf where a leaf of b did not move
    but a differs from it."""
    leaves = [jax.tree.leaves(t) for t in (a, b, origin)]
    if len({len(x) for x in leaves}) != 1:
        raise ValueError(f"trees differ: {[len(x) for x in leaves]} leaves")
    worst = 0.0
    for x, y, z in zip(*leaves):
        y = np.asarray(y, np.float64)
        off = np.linalg.norm(np.asarray(x, np.float64) - y)
        moved = np.linalg.norm(y - np.asarray(z, np.float64))
        ratio = off / moved if moved > 0 else (0.0 if off == 0 else np.inf)
        if np.isnan(ratio):
            return float("nan")
        worst = max(worst, float(ratio))
    return worst


def python_path() -> str:
    """PYTHONPATH for a Python subprocess a test starts: the repository root ahead of this
    session's own PYTHONPATH (on a machine whose packages come by PYTHONPATH, as on the GPU
    machine of ../shared/bench, replacing it would hide them from the child)."""
    from tests.conftest import REPO_ROOT
    return os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)


def default_codegen_env() -> dict:
    """This session's environment less the XLA:CPU code-generation flags tests/conftest.py adds
    for compile speed (conftest.SUITE_CODEGEN_FLAGS): a subprocess started with it compiles as a
    user's run does, with XLA's defaults."""
    from tests.conftest import SUITE_CODEGEN_FLAGS
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not any(name in f for name in SUITE_CODEGEN_FLAGS))
    return env


def cpu_process_env(devices: int) -> dict:
    """The environment for a worker process a test starts on the CPU with `devices` devices: this
    session's, less its device count and any jax.distributed settings, keeping its other XLA flags
    (conftest: the CPU code-generation level)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                        "JAX_PROCESS_ID")}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    env.update(XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
               JAX_PLATFORMS="cpu")
    return env
