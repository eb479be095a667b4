"""scripts/gpu_bench.sh: every stage's command lines, printed by its DRY_RUN mode, name scripts,
configs and test files that exist and arguments that those scripts' parsers accept, so a flag
renamed in a benchmark (or a stage's typo) fails here on the CPU instead of in a device call,
whose time is scarce (the eighth GPU run lost a call to the script itself). The XLA_FLAGS the
stages set (each decode_flags variant's among them) are parsed by this machine's jaxlib (the
ninth run lost a call to a value XLA refuses); a flag name that only the GPU image's newer jaxlib knows is listed in
NEWER_XLA_FLAGS (checked with scripts/gpu_jax_check.sh's venv)."""
import argparse
import importlib
import importlib.metadata
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_bench.sh"
STAGE_LINE = re.compile(r"^=== stage (\S+) \(limit (\d+)s\): (.*)$")


def stage_names() -> list:
    """The stages gpu_bench.sh's case statement takes (each alternative of a pattern)."""
    names = []
    for line in SCRIPT.read_text().splitlines():
        m = re.match(r"^    ([a-z][a-z0-9_|-]*)\)", line)
        if m:
            names += m.group(1).split("|")
    return names


def dry_run(stages, **env) -> list:
    """(stage name, limit, argv) of each command DRY_RUN=1 prints for `stages`."""
    run_env = {k: v for k, v in os.environ.items()
               if k not in ("DECODE_ATTENTION", "BUNDLE", "OUT", "XLA_FLAGS")}
    run_env.update(DRY_RUN="1", **env)
    proc = subprocess.run(["bash", str(SCRIPT), *stages], capture_output=True, text=True,
                          env=run_env, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "unknown" not in proc.stdout, proc.stdout
    commands = []
    for line in proc.stdout.splitlines():
        m = STAGE_LINE.match(line)
        assert m, f"not a stage line: {line!r}"
        commands.append((m.group(1), int(m.group(2)), shlex.split(m.group(3))))
    return commands


class _Parsed(Exception):
    pass


def check_command(argv, monkeypatch):
    """Check one command line: `env` and VAR=value prefixes dropped; a benchmark script's
    arguments parsed by its own parser (its module's parse_args where it has one, with the
    checks that follow parsing, else argparse inside its main); pytest's test paths and
    delta_jax.main's config file exist. Returns what was checked."""
    argv = list(argv)
    if argv and argv[0] == "env":
        argv.pop(0)
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        argv.pop(0)
    assert argv[0] == "python3", argv
    if argv[1] == "-m" and argv[2] == "pytest":
        paths = [a for a in argv[3:] if a.startswith("tests")]
        assert paths, argv
        for path in paths:
            assert (ROOT / path.split("::")[0]).exists(), path
        if "-m" in argv[3:]:
            marker = argv[3:][argv[3:].index("-m") + 1]
            assert marker in ("gpu",), f"unregistered marker {marker}"
        return "pytest"
    if argv[1] == "-m" and argv[2] == "delta_jax.main":
        configs = [a.split("=", 1)[1] for a in argv[3:] if a.startswith("--config=")]
        assert configs and (ROOT / configs[0]).is_file(), argv
        # Its flags against the config: the same command in plan mode (shapes only, no device),
        # which validates the config and plans it for one CUDA GPU.
        plan_argv = [sys.executable, *argv[1:], "--config.mode=plan", "--config.plan.target=cuda",
                     "--config.plan.num_devices=1", "--config.mesh.data=1"]
        out = subprocess.run(plan_argv, capture_output=True, text=True, timeout=300, cwd=str(ROOT),
                             env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
        assert out.returncode == 0, f"{' '.join(argv)}:\n{out.stdout[-1500:]}{out.stderr[-1500:]}"
        return "main"
    script = pathlib.Path(argv[1])
    if script.parts[0] == ".whl":  # the peer's script from ../shared/bench, not in the repository
        return "peer"
    assert script.parts[0] == "benchmarks" and (ROOT / script).is_file(), argv
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = importlib.import_module(script.stem)
    args = argv[2:]
    try:
        if hasattr(module, "parse_args"):
            module.parse_args(args)
        else:
            original = argparse.ArgumentParser.parse_args

            def parse_then_stop(self, *a, **k):
                original(self, *a, **k)
                raise _Parsed

            with monkeypatch.context() as m:
                m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
                with pytest.raises(_Parsed):
                    module.main(args)
    except SystemExit as e:  # argparse's error exit
        pytest.fail(f"{' '.join(argv)}: its parser refused the arguments (exit {e.code})")
    return "benchmark"


def test_every_stage_has_commands_that_parse(monkeypatch, capsys):
    """All stages at once (their default loops and variants): each prints at least one command
    (decode_anatomy's HLO stage only follows a real run's dump), and each command checks out."""
    names = stage_names()
    assert {"decode_fused", "shrink_ab", "suite", "paged_rows", "decode_rows"} <= set(names)
    kinds = set()
    for stage in names:
        commands = dry_run([stage])
        assert commands, f"stage {stage} printed no command"
        for _, limit, argv in commands:
            assert limit > 0
            kinds.add(check_command(argv, monkeypatch))
    capsys.readouterr()  # the parsers' help output, if any
    assert kinds == {"benchmark", "pytest", "main", "peer"}


def test_stage_variables_change_the_commands(monkeypatch):
    """The environment knobs the next GPU calls use (DECODE_ATTENTION, FUSED_BATCHES,
    SHRINK_BATCHES, TAIL_MODES, ROWS_BATCHES, MOSAIC_ROWS, SUITE_TESTS, SUITE_WORKERS,
    PROFILE_TAIL_BATCH, INVARIANT_BATCHES) reach the
    commands, and what they make still parses."""
    commands = dry_run(["decode_fused", "shrink_ab", "longtail_shrink", "decode_rows", "suite",
                        "profile_longtail", "batch_invariant"], PROFILE_TAIL_BATCH="256",
                       INVARIANT_BATCHES="64",
                       DECODE_ATTENTION="mosaic_fused", FUSED_BATCHES="64 256",
                       SHRINK_BATCHES="256", TAIL_MODES="continuous static static_shrunk",
                       ROWS_BATCHES="64", MOSAIC_ROWS="1 4",
                       SUITE_TESTS="tests/test_paged_decode.py tests/test_sampling.py",
                       SUITE_WORKERS="4")
    names = [name for name, _, _ in commands]
    assert names[:4] == ["decode_fused_fused_64_1", "decode_fused_unfused_64_1",
                         "decode_fused_fused_256_2", "decode_fused_unfused_256_2"]
    assert "shrink_ab_256" in names and "shrink_ab_64" not in names
    assert ["decode_rows_1_64_1", "decode_rows_4_64_1"] == [n for n in names
                                                            if n.startswith("decode_rows")]
    by_name = {name: argv for name, _, argv in commands}
    shrink = by_name["longtail_shrink"]
    assert shrink[shrink.index("--tail-modes") + 1:][:3] == ["continuous", "static",
                                                             "static_shrunk"]
    rows = by_name["decode_rows_4_64_1"]
    assert rows[rows.index("--decode-attention") + 1] == "mosaic_fused"
    assert rows[rows.index("--mosaic-rows") + 1] == "4"
    assert rows[rows.index("--output") + 1].endswith("_mosaic_fused.json")
    suite = by_name["suite"]
    # the workers where python3 has pytest-xdist, else one process
    assert "-n" not in suite or suite[suite.index("-n") + 1] == "4"
    assert suite[-2:] == ["tests/test_paged_decode.py", "tests/test_sampling.py"]
    tail = by_name["profile_longtail"]
    assert tail[tail.index("--batch") + 1:][:2] == ["256", "--prompt-len"]
    invariant = by_name["batch_invariant_64"]  # half the slots for the tokens-only variant
    assert invariant[invariant.index("--other-batches") + 1] == "32"
    assert invariant[invariant.index("--batch-invariant") + 1:][:2] == ["0", "1"]
    for _, _, argv in commands:
        check_command(argv, monkeypatch)


def test_a_stale_flag_is_caught(monkeypatch):
    """Positive control: a flag no parser knows, in a script with parse_args and in one that
    parses inside main, fails the check; so does a missing test file or script, and a
    delta_jax.main config field that does not exist or whose value it refuses."""
    with pytest.raises(pytest.fail.Exception, match="refused"):
        check_command(["python3", "benchmarks/sampler_ab.py", "--batch", "64", "--no-such-flag"],
                      monkeypatch)
    with pytest.raises(pytest.fail.Exception, match="refused"):
        check_command(["python3", "benchmarks/lm_head_logprob.py", "--tokens-per-chunk", "8"],
                      monkeypatch)
    with pytest.raises(AssertionError):
        check_command(["env", "JAX_PLATFORMS=cuda,cpu", "python3", "-m", "pytest",
                       "tests/test_no_such_file.py"], monkeypatch)
    with pytest.raises(AssertionError):
        check_command(["python3", "benchmarks/no_such_benchmark.py"], monkeypatch)
    # delta_jax.main: a config field that does not exist, or a value its validation refuses.
    main = ["python3", "-m", "delta_jax.main", "--config=experiments/synthetic_gpu.py"]
    for bad in ("--config.rl.old_pass_rowz=64", "--config.rl.old_pass_rows=-1"):
        with pytest.raises(AssertionError, match="old_pass_row"):
            check_command(main + [bad], monkeypatch)
    assert check_command(main + ["--config.rl.old_pass_rows=64"], monkeypatch) == "main"
    # and the real arguments pass
    assert check_command(["python3", "benchmarks/lm_head_logprob.py", "--tokens", "8"],
                         monkeypatch) == "benchmark"


# Flags of the decode_flags variants that the GPU image's jaxlib (0.11.2) takes and older ones do
# not know (checked 2026-11-27 with scripts/gpu_jax_check.sh's .venv-gpujax: every variant parses
# there). Only a name listed here may be unknown to this machine's jaxlib, and only if that
# jaxlib is older than the image's.
GPU_IMAGE_JAXLIB = (0, 11, 2)
NEWER_XLA_FLAGS = {"xla_gpu_enable_pdl_launch"}


def decode_flag_variants() -> list:
    """The variant names of gpu_bench.sh's decode_flags case."""
    return re.findall(r"^ {10}([a-z_]+)\) flags=", SCRIPT.read_text(), flags=re.M)


def xla_flags_refusals(flag_sets: dict, allow_unknown=()) -> dict:
    """{stage: complaint} for the stages whose XLA_FLAGS (flag_sets: stage -> flags) this
    machine's jaxlib refuses; flags named in allow_unknown are left out. A process parses one
    value of each flag name (XLA aborts at its first bad flag, and a later value of a name would
    hide an earlier one), so the flags of all stages go into as few processes as the most values
    one name has; a refused process's stages are then parsed one by one, to say whose it is."""
    flags = {}  # stage -> [(name, "--name=value")]
    for stage, text in flag_sets.items():
        named = [(f.split("=", 1)[0].lstrip("-"), f) for f in shlex.split(text)]
        flags[stage] = [(name, f) for name, f in named if name not in allow_unknown]
    rounds = []  # [({name: flag}, {stage whose flags it holds})]: a flag goes to the first
    for stage, pairs in flags.items():  # round holding that flag or no value of its name
        for name, flag in pairs:
            r, stages = next(((r, s) for r, s in rounds if r.get(name, flag) == flag), ({}, set()))
            if not r:
                rounds.append((r, stages))
            r[name] = flag
            stages.add(stage)
    refused = {}
    for r, stages in rounds:
        together = xla_flags_refusal(" ".join(r.values()))
        if together:
            alone = {stage: xla_flags_refusal(" ".join(flag for _, flag in flags[stage]))
                     for stage in sorted(stages - set(refused))}
            refused.update({stage: c for stage, c in alone.items() if c})
            if not any(stage in refused for stage in stages):  # refused only together
                refused[", ".join(sorted(stages))] = together
    return refused


def xla_flags_refusal(xla_flags: str) -> str:
    """"" if this machine's jaxlib starts a backend under XLA_FLAGS=xla_flags, else its
    complaint (the log line naming the flag or value)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.ones(2).block_until_ready()"],
                          capture_output=True, text=True, env=env, timeout=120)
    if proc.returncode == 0:
        return ""
    lines = [l for l in proc.stderr.splitlines() if re.search(r"Unknown flag|Illegal value", l)]
    return lines[0] if lines else proc.stderr[-2000:]


def test_every_stages_xla_flags_parse():
    """Every XLA_FLAGS a stage's DRY_RUN command line sets (each decode_flags variant, and the
    other stages' own) is taken by XLA's flag parser: no illegal value, and no unknown name
    except the listed newer ones."""
    variants = decode_flag_variants()
    assert {"base", "graph_while", "pdl_on", "no_splitk"} <= set(variants)
    commands = dry_run(["decode_flags"], DECODE_FLAG_VARIANTS=" ".join(variants))
    assert [name for name, _, _ in commands] == [f"decode_flags_{v}" for v in variants]
    commands += [c for stage in stage_names() if stage != "decode_flags"
                 for c in dry_run([stage])]
    older = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:3]) \
        < GPU_IMAGE_JAXLIB
    flag_sets = {}
    for name, _, argv in commands:
        sets = [a.split("=", 1)[1] for a in argv if a.startswith("XLA_FLAGS=")]
        if sets:
            flag_sets[name] = sets[0]
    # all decode_flags variants but base set flags
    assert {f"decode_flags_{v}" for v in variants if v != "base"} <= set(flag_sets)
    assert not xla_flags_refusals(flag_sets, allow_unknown=NEWER_XLA_FLAGS if older else ())


def test_a_refused_xla_flag_is_caught():
    """Positive control: the value the ninth GPU run's graph_while variant had, and an unknown
    flag name, are reported; a good value is not. Among several stages' flags (parsed together),
    the refusal is the stage's whose flag it is; an allowed unknown name is left out and the rest
    of its stage's flags are still parsed."""
    bad_value = "--xla_gpu_enable_command_buffer=FUSION,DYNAMIC_SLICE_COPY_FUSION"
    assert "Illegal value" in xla_flags_refusal(bad_value)
    assert "Unknown flag" in xla_flags_refusal("--xla_gpu_no_such_flag=true")
    assert xla_flags_refusal("--xla_gpu_enable_command_buffer=FUSION,WHILE") == ""
    refused = xla_flags_refusals({
        "a": "--xla_gpu_enable_command_buffer=FUSION,WHILE --xla_gpu_enable_pdl=true",
        "b": "--xla_gpu_enable_command_buffer= --xla_gpu_enable_pdl=false",
        "c": f"--xla_gpu_enable_pdl=true {bad_value}",
        "d": f"--xla_gpu_no_such_flag=true {bad_value}"}, allow_unknown={"xla_gpu_no_such_flag"})
    assert sorted(refused) == ["c", "d"], refused
    assert all("Illegal value" in complaint for complaint in refused.values()), refused
