"""Command line entry point.

    python -m delta_jax.main --config=experiments/tiny.py --workdir=runs/tiny \
        [--config.method=grpo|dapo|delta] [--config.mode=train|sft|eval|plan] [--config.a.b=value ...]

`--config.mode=plan` prints the per-device memory plan of the config on config.plan.num_devices
devices of config.plan.device_memory_gb (delta_jax/plan.py) and needs no --workdir. Several
processes (TPU pod, SLURM, or config.distributed.*) start jax.distributed before anything else.

The config file's get_config() gives an ml_collections ConfigDict (see
delta_jax/train/config.py for every field); each field can be overridden with --config.a.b=value.
The config is validated before anything is built: an unknown field, a wrong type or an impossible
combination stops the program with a message naming the field (exit code 2), as does a config
file that does not load. A missing or malformed input (data, benchmark, tokenizer or checkpoint
file; data that does not fit the config: delta_jax/errors.py) stops it with one line naming the
file and field (exit code 1). A run resumes automatically from the latest checkpoint in --workdir
that reads back; a resume whose config changes a field that changes results lists the changes and
stops unless --config.train.allow_config_change=True. One process at a time may use a workdir.

SIGINT / SIGTERM (Ctrl-C, preemption) stop a training run after the step in hand with a checkpoint,
a one-line message and exit code 130 / 143; a second signal exits at once.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import sys
import traceback

from absl import app, flags
from ml_collections import config_flags

from delta_jax import files
from delta_jax.errors import InputError, RunHalted
from delta_jax.train.config import (ConfigError, field_names, resume_changes, unused_delta_fields,
                                    validate_config)

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (get_config())",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory: checkpoints, metrics, events")


def run(cfg, workdir: str):
    """Validates `cfg` and runs its mode in `workdir`; returns the mode's result."""
    cfg = validate_config(cfg)
    unused = unused_delta_fields(cfg)
    if unused:
        logging.getLogger("delta_jax").warning(
            "method=%r trains without DelTA weights: %s change nothing it trains (method=delta "
            "uses them)", cfg.method, ", ".join(unused))
    from delta_jax import xla_env
    xla_env.apply_default_flags()  # before anything starts a backend
    if cfg.mode == "plan":
        from delta_jax import plan
        result = plan.plan_from_config(cfg, target=cfg.plan.target)
        print(result.to_text())
        return result
    from delta_jax import sharding
    sharding.initialize_distributed(cfg.distributed.coordinator_address,
                                    cfg.distributed.num_processes, cfg.distributed.process_id,
                                    heartbeat_timeout_s=cfg.distributed.heartbeat_timeout_s)
    import jax
    xla_env.enable_compilation_cache(cfg.train.compilation_cache_dir, jax.default_backend())
    os.makedirs(workdir, exist_ok=True)
    if jax.process_index() != 0:  # one console: the other hosts log only warnings and errors
        logging.getLogger("delta_jax").setLevel(logging.WARNING)

    from delta_jax.train.workdir_lock import WorkdirLock
    lock = WorkdirLock(workdir) if jax.process_index() == 0 else None
    if lock is not None:
        lock.acquire()  # before the devices line: a refused second run says one line
    try:
        devices = jax.devices()
        logging.getLogger("delta_jax").info(
            "devices: %d x %s (%s backend), %d process(es)", len(devices),
            devices[0].device_kind, jax.default_backend(), jax.process_count())
        changes = check_resume_config(cfg, workdir) if cfg.mode in ("train", "sft") else []
        # A resume that changes results (train.allow_config_change) replaces config.json only
        # once its checkpoint has read back: until then the file still describes what trained
        # the checkpoints (a start that fails leaves it so), and the old one is kept after.
        on_resumed = None
        if jax.process_index() == 0 and cfg.mode != "eval":
            if changes:
                on_resumed = functools.partial(adopt_config, cfg, workdir, changes)
            else:
                write_config(cfg, workdir)
        from delta_jax.train import loop  # heavy imports only after the config is known good

        if cfg.mode == "sft":
            return loop.sft_only(cfg, workdir, on_resumed=on_resumed)
        if cfg.mode == "eval":
            return loop.eval_only(cfg, workdir)
        state, run_ = loop.train(cfg, workdir, on_resumed=on_resumed)
        run_.close()
        if jax.process_index() == 0:  # plots + held-out accuracy before / after RL
            from delta_jax.train import plots
            print(plots.write_report(workdir, cfg.train.steps), flush=True)
        return state
    finally:
        if lock is not None:
            lock.release()


def write_config(cfg, workdir: str) -> None:
    """workdir/config.json, replaced at once (a temporary file, then os.replace): the other
    processes of a multi-host run read it in check_resume_config while process 0 writes it, and
    a file rewritten in place can be read half-written."""
    files.write_text(os.path.join(workdir, "config.json"),
                     json.dumps(cfg.to_dict(), indent=2, sort_keys=True))


def adopt_config(cfg, workdir: str, changes: list[str], resumed: str) -> None:
    """After a resume with results-changing fields changed has read its checkpoint back
    (`resumed`: "step_N" or "sft_step_N", 0 when nothing was restored): the config.json that
    trained the run up to there is kept as config.until_<resumed>.json, and `cfg` replaces it."""
    path = os.path.join(workdir, "config.json")
    kept = files.unused_path(os.path.join(workdir, f"config.until_{resumed}"), ".json")
    if os.path.isfile(path):
        os.replace(path, kept)
    write_config(cfg, workdir)
    logging.getLogger("delta_jax").info(
        "config.json: this run's config from %s on (%s); the one before is kept as %s",
        resumed.replace("_", " "), "; ".join(changes), os.path.basename(kept))


def check_resume_config(cfg, workdir: str) -> list[str]:
    """A run directory with checkpoints resumes only with the config it was started with (fields
    that change no result aside, config.RESUMABLE_FIELDS) unless train.allow_config_change.
    Returns the changes allowed that way ("field: old -> new"; [] when there are none)."""
    path = os.path.join(workdir, "config.json")
    from delta_jax.train import CHECKPOINTS, SFT_CHECKPOINTS
    dirs = [os.path.join(workdir, name) for name in (CHECKPOINTS, SFT_CHECKPOINTS)]
    has_ckpt = any(os.path.isdir(d) and any(n.isdigit() for n in os.listdir(d)) for d in dirs)
    if not (has_ckpt and os.path.isfile(path)):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: the saved config of this run does not read back ({e}); "
                          "restore it or use another --workdir") from None
    changes = resume_changes(saved, cfg.to_dict())
    if changes and not cfg.train.allow_config_change:
        listed = "\n  ".join(changes)
        raise ConfigError(
            f"train.allow_config_change: {workdir} holds a run started with another config; "
            f"resuming it would change:\n  {listed}\nRun with the old values, use another "
            "--workdir, or pass --config.train.allow_config_change=True to resume anyway")
    if changes:
        logging.getLogger("delta_jax").warning("resuming with a changed config:\n  %s",
                                               "\n  ".join(changes))
    return changes


def parse_flags(argv):
    """absl's flag parsing with short messages for the config's errors: an unknown
    --config.field, or a config file that does not load (exit code 2, no traceback)."""
    try:
        rest = flags.FLAGS(argv)
        cfg = flags.FLAGS["config"].value
        if cfg is not None:
            cfg.keys()  # a config file that failed to load raises here, not while parsing
        return rest
    except flags.Error as e:
        print(f"{os.path.basename(argv[0])}: {e}\nPass --helpshort for the flags.",
              file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # noqa: BLE001 -- raised by loading or overriding the config
        known = field_names()
        for arg in argv[1:]:
            if arg.startswith("--config."):
                field = arg[len("--config."):].split("=", 1)[0]
                if field not in known:
                    section = field.rsplit(".", 1)[0] if "." in field else ""
                    siblings = sorted(k[len(section) + 1:] for k in known
                                      if k.startswith(section + ".")
                                      and "." not in k[len(section) + 1:])
                    hint = (f" (fields of {section}: {', '.join(siblings)})"
                            if section in known else "")
                    print(f"config error: --config.{field}: unknown config field{hint}",
                          file=sys.stderr)
                    sys.exit(2)
        root = e
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        text = str(root)
        if "Failed loading config file" in text:  # ml_collections: the file's own error last
            text = text.strip().splitlines()[-1].strip()
        where = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), "")
        detail = f"{type(root).__name__}: {text}"
        if isinstance(root, SyntaxError):
            detail = f"SyntaxError: {root.msg} ({root.filename}, line {root.lineno})"
        print(f"config error: --config={where}: {detail}", file=sys.stderr)
        sys.exit(2)


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
    # jax logs at INFO each backend it could not start: "Unable to initialize backend 'tpu'"
    # opened every run on a machine without a TPU. run()'s "devices:" line says what runs.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    from delta_jax.train.preemption import TrainingInterrupted
    from delta_jax.train.workdir_lock import WorkdirBusy
    try:
        run(_CONFIG.value, _WORKDIR.value)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        exit_alone(2)
    except (InputError, WorkdirBusy) as e:  # a missing / malformed file, data that does not
        print(f"error: {e}", file=sys.stderr)  # fit; a busy workdir (process 0 alone holds it)
        exit_alone(1)
    except TrainingInterrupted as e:  # every process stops at the same step (agreed)
        print(str(e), file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except RunHalted as e:  # a checkpoint is saved; every process halts at this step (global)
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - reported, then the process leaves at once
        if not _distributed_started():
            raise
        from delta_jax.sharding import PartnerGone
        if isinstance(e, PartnerGone):  # another process stopped: its own log says why
            print(f"error: {e}", file=sys.stderr)
        else:
            traceback.print_exc()
        exit_alone(1)


def _distributed_started() -> bool:
    if "jax" not in sys.modules:  # a config error before anything imported jax: one process
        return False
    from delta_jax import sharding
    return sharding.distributed_started()


def exit_alone(code: int):
    """Exits with `code`. In a multi-process run this process may be the only one stopping:
    leaving through Python's exit would wait in jax.distributed's shutdown barrier for processes
    that are waiting for it in a collective (minutes, then an abort of all). Instead it leaves
    at once (output flushed, no exit handlers: Orbax keeps only checkpoints it finished), and
    the distributed runtime stops the others: at once when this is process 0 (it hosts the
    coordination service), else when this process's heartbeats are missed
    (distributed.heartbeat_timeout_s)."""
    if not _distributed_started():
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
