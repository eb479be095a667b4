"""delta_jax.xla_env: the default XLA flags, the user's XLA_FLAGS winning, and main.run setting
them before the backend starts."""
import os
import pathlib
import subprocess
import sys

import jax

from delta_jax import xla_env

REPO = pathlib.Path(__file__).resolve().parents[1]
CONCURRENT = "--xla_gpu_graph_enable_concurrent_region=true"


def test_the_concurrent_graph_flag_is_a_default():
    assert CONCURRENT in xla_env.DEFAULT_XLA_FLAGS


def test_merged_flags_append_the_defaults_the_user_did_not_name():
    defaults = ("--xla_a=1", "--xla_b=true")
    assert xla_env.merged_flags("", defaults) == "--xla_a=1 --xla_b=true"
    assert xla_env.merged_flags("  --xla_c=2  ", defaults) == "--xla_c=2 --xla_a=1 --xla_b=true"
    # a flag the user names, to any value, wins; the merge is idempotent
    assert xla_env.merged_flags("--xla_b=false", defaults) == "--xla_b=false --xla_a=1"
    assert xla_env.merged_flags("--xla_b", defaults) == "--xla_b --xla_a=1"
    once = xla_env.merged_flags("--xla_c=2", defaults)
    assert xla_env.merged_flags(once, defaults) == once
    assert xla_env.missing_flags(once, defaults) == []


def test_apply_default_flags_sets_a_given_environment_once():
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert xla_env.apply_default_flags(env) == xla_env.DEFAULT_XLA_FLAGS
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", *xla_env.DEFAULT_XLA_FLAGS]
    assert xla_env.apply_default_flags(env) == ()
    flagfile = {"XLA_FLAGS": "/path/to/xla_flags.txt"}   # XLA reads the file: left alone
    assert xla_env.apply_default_flags(flagfile) == ()
    assert flagfile == {"XLA_FLAGS": "/path/to/xla_flags.txt"}
    blank = {"XLA_FLAGS": " "}                             # blank: XLA would fail on it as a file
    assert xla_env.apply_default_flags(blank) == xla_env.DEFAULT_XLA_FLAGS
    assert blank["XLA_FLAGS"] == " ".join(xla_env.DEFAULT_XLA_FLAGS)
    off = {"XLA_FLAGS": CONCURRENT.replace("true", "false")}
    assert xla_env.apply_default_flags(off) == ()
    assert off == {"XLA_FLAGS": "--xla_gpu_graph_enable_concurrent_region=false"}


def test_after_the_backend_started_the_process_environment_is_left_alone(monkeypatch):
    jax.devices()  # the backend has started: XLA read XLA_FLAGS already
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert xla_env.backends_started()
    assert xla_env.apply_default_flags() == ()
    assert "XLA_FLAGS" not in os.environ


def test_main_run_sets_them_before_the_backend_starts_and_xla_takes_them(tmp_path):
    """A fresh process: delta_jax.main.run (plan mode, the cheapest) leaves XLA_FLAGS with the
    defaults beside the user's flag, before any backend started; the backend then starts with
    them (XLA aborts the process on a flag it does not know) and computes."""
    script = (
        "import importlib.util, os, sys\n"
        "from delta_jax import main, xla_env\n"
        "spec = importlib.util.spec_from_file_location('tiny', sys.argv[1])\n"
        "tiny = importlib.util.module_from_spec(spec); spec.loader.exec_module(tiny)\n"
        "cfg = tiny.get_config(); cfg.mode = 'plan'\n"
        "assert not xla_env.backends_started()\n"
        "main.run(cfg, '')\n"
        "print('FLAGS', os.environ['XLA_FLAGS'])\n"
        "import jax, jax.numpy as jnp\n"
        "print('SUM', float(jnp.arange(4.0).sum()), jax.default_backend())\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS="--xla_cpu_enable_fast_math=false", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", script, str(REPO / "experiments" / "tiny.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    flags = next(l for l in out.stdout.splitlines() if l.startswith("FLAGS ")).split()[1:]
    assert flags == ["--xla_cpu_enable_fast_math=false", *xla_env.DEFAULT_XLA_FLAGS]
    assert "SUM 6.0 cpu" in out.stdout
