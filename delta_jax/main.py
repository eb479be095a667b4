"""Command line entry point.

    python -m delta_jax.main --config=experiments/tiny.py --workdir=runs/tiny \
        [--config.method=grpo|dapo|delta] [--config.mode=train|sft|eval|plan] [--config.a.b=value ...]

`--config.mode=plan` prints the per-device memory plan of the config on config.plan.num_devices
devices of config.plan.device_memory_gb (delta_jax/plan.py) and needs no --workdir. Several
processes (TPU pod, SLURM, or config.distributed.*) start jax.distributed before anything else.

The config file's get_config() gives an ml_collections ConfigDict (see
delta_jax/train/config.py for every field); each field can be overridden with --config.a.b=value.
The config is validated before anything is built: an unknown field, a wrong type or an impossible
combination stops the program with a message naming the field. A run resumes automatically from
the latest checkpoint in --workdir.
"""
from __future__ import annotations

import json
import logging
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from delta_jax.train.config import ConfigError, validate_config

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (get_config())",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory: checkpoints, metrics, events")


def run(cfg, workdir: str):
    """Validates `cfg` and runs its mode in `workdir`; returns the mode's result."""
    cfg = validate_config(cfg)
    if cfg.mode == "plan":
        from delta_jax import plan
        result = plan.plan_from_config(cfg)
        print(result.to_text())
        return result
    from delta_jax import sharding
    sharding.initialize_distributed(cfg.distributed.coordinator_address,
                                    cfg.distributed.num_processes, cfg.distributed.process_id)
    os.makedirs(workdir, exist_ok=True)
    import jax
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2, sort_keys=True)
    from delta_jax.train import loop  # heavy imports only after the config is known to be good

    if cfg.mode == "sft":
        return loop.sft_only(cfg, workdir)
    if cfg.mode == "eval":
        return loop.eval_only(cfg, workdir)
    state, run_ = loop.train(cfg, workdir)
    run_.close()
    if jax.process_index() == 0:  # plots + held-out accuracy before / after RL
        from delta_jax.train import plots
        print(plots.write_report(workdir, cfg.train.steps), flush=True)
    return state


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None:
        raise app.UsageError("--config is required (e.g. experiments/tiny.py)")
    if _WORKDIR.value is None and _CONFIG.value.mode != "plan":
        raise app.UsageError("--workdir is required")
    logging.getLogger("delta_jax").setLevel(logging.INFO)
    # Orbax logs every save step by step at INFO through absl; keep the console readable.
    logging.getLogger("absl").setLevel(logging.WARNING)
    try:
        run(_CONFIG.value, _WORKDIR.value)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
