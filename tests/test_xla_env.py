"""delta_jax.xla_env: the default XLA flags, the user's XLA_FLAGS winning, and main.run setting
them before the backend starts."""
import os
import pathlib
import subprocess
import sys

import jax
import pytest

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


def test_the_users_jax_compilation_cache_dir_wins(tmp_path, monkeypatch):
    """JAX_COMPILATION_CACHE_DIR, where set, is left to JAX (its value in use, "" = no cache);
    so is a train.compilation_cache_dir of "": then nothing is configured or created."""
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/u")
    assert xla_env.enable_compilation_cache(str(tmp_path / "c"), "gpu") == "/u"
    assert xla_env.enable_compilation_cache(str(tmp_path / "c"), "cpu") == "/u"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")
    assert xla_env.enable_compilation_cache(str(tmp_path / "c"), "gpu") is None
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert xla_env.enable_compilation_cache("", "gpu") is None
    assert not (tmp_path / "c").exists() and jax.config.jax_compilation_cache_dir == before


CACHED_RUN = (
    "import logging, sys\n"
    "logging.basicConfig(level=logging.DEBUG)\n"
    "from delta_jax import xla_env\n"
    "print('DIR', xla_env.enable_compilation_cache(sys.argv[1], sys.argv[2]))\n"
    "import jax, jax.numpy as jnp\n"
    "print('SUM', float(jax.jit(lambda x: jnp.sin(x).sum())(jnp.arange(8.0))))\n")


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    """Fresh processes without JAX_COMPILATION_CACHE_DIR, for an accelerator backend: the first
    compiles a program into the configured directory ("~" expanded against HOME), the second
    loads it from there (JAX's log says "cache hit") and computes the same. (What is exercised
    is JAX's cache on the platform the test runs on, here the CPU, which stands in for the
    accelerator `enable_compilation_cache` is told of.) For the CPU backend nothing is cached."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_ENABLE_COMPILATION_CACHE"))}
    env.update(HOME=str(tmp_path), JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # cache even a tiny program
    cache = tmp_path / ".cache" / "delta_jax" / "jax"

    def run(backend):
        out = subprocess.run([sys.executable, "-c", CACHED_RUN, "~/.cache/delta_jax/jax",
                              backend], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "SUM " in out.stdout
        return out

    cpu = run("cpu")
    assert "DIR None" in cpu.stdout and not cache.exists()
    runs = [run("gpu") for _ in range(2)]
    for out in runs:
        assert f"DIR {cache}" in out.stdout
    assert len({l for out in (cpu, *runs) for l in out.stdout.splitlines()
                if l.startswith("SUM")}) == 1
    assert any(cache.iterdir())
    assert "cache hit" not in runs[0].stderr.lower()
    assert "cache hit" in runs[1].stderr.lower(), runs[1].stderr[-3000:]


def test_main_run_configures_the_cache_before_it_builds_anything(tmp_path, monkeypatch):
    """delta_jax.main.run hands train.compilation_cache_dir to enable_compilation_cache before the
    run is built (here the training loop is stopped at its start); plan mode compiles nothing and
    configures nothing."""
    import importlib.util
    from delta_jax import main
    from delta_jax.train import loop

    calls = []

    class Stop(Exception):
        pass

    def stopped(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(xla_env, "enable_compilation_cache",
                        lambda d, backend: calls.append((d, backend)))
    monkeypatch.setattr(loop, "train", stopped)
    spec = importlib.util.spec_from_file_location("tiny", REPO / "experiments" / "tiny.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    cfg = tiny.get_config()
    cfg.train.compilation_cache_dir = str(tmp_path / "cache")
    with pytest.raises(Stop):
        main.run(cfg, str(tmp_path / "run"))
    assert calls == [(str(tmp_path / "cache"), jax.default_backend())]
    cfg.mode = "plan"
    main.run(cfg, "")
    assert calls == [(str(tmp_path / "cache"), jax.default_backend())]
