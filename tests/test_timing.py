"""kernels.timing's timers (calls per sample, copy bandwidth) and profile summary (the
compiled-memory helpers are tested in test_plan.py)."""
import gzip
import json
import math
import os

import jax
import jax.numpy as jnp
import pytest

from delta_jax.kernels import timing


def _write_trace(folder, events):
    path = folder / "plugins" / "profile" / "run" / "host.trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_trace_summary_sums_device_kernels_by_name(tmp_path):
    """Known answer: complete events of the device process summed by name, largest first; host
    events, metadata and other phases left out; share over the device time."""
    meta = lambda pid, name: {"ph": "M", "name": "process_name", "pid": pid,  # noqa: E731
                              "args": {"name": name}}
    x = lambda pid, name, dur: {"ph": "X", "pid": pid, "name": name, "dur": dur, "ts": 0}  # noqa
    _write_trace(tmp_path, [
        meta(1, "/device:GPU:0"), meta(2, "/host:CPU"),
        x(1, "attention", 30.0), x(1, "memcpy", 5.0), x(1, "attention", 40.0), x(1, "gemm", 25.0),
        x(2, "attention", 1000.0), {"ph": "i", "pid": 1, "name": "marker", "ts": 3}])
    rows = timing.trace_summary(tmp_path)
    assert [(r["process"], r["name"], r["total_us"], r["count"]) for r in rows] == [
        ("/device:GPU:0", "attention", 70.0, 2), ("/device:GPU:0", "gemm", 25.0, 1),
        ("/device:GPU:0", "memcpy", 5.0, 1)]
    assert [r["share"] for r in rows] == pytest.approx([0.7, 0.25, 0.05])
    assert len(timing.trace_summary(tmp_path, top=1)) == 1


def test_trace_summary_keeps_each_programs_kernels_apart(tmp_path):
    """Events carrying an "hlo_module" argument are summed per program: one kernel name in two
    programs is two rows, each naming its module; events without it have module ""."""
    def x(name, dur, module=None):
        args = {} if module is None else {"hlo_module": module, "hlo_op": name}
        return {"ph": "X", "pid": 1, "name": name, "dur": dur, "ts": 0, "args": args}
    _write_trace(tmp_path, [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        x("loop_select_fusion_1", 2.0, "jit_decode"), x("loop_select_fusion_1", 2.0, "jit_decode"),
        x("loop_select_fusion_1", 90.0, "jit_prefill"), x("memcpy", 6.0)])
    rows = timing.trace_summary(tmp_path)
    assert [(r["module"], r["name"], r["total_us"], r["count"]) for r in rows] == [
        ("jit_prefill", "loop_select_fusion_1", 90.0, 1), ("", "memcpy", 6.0, 1),
        ("jit_decode", "loop_select_fusion_1", 4.0, 2)]


def test_trace_summary_reads_what_jax_profiler_writes(tmp_path, few_executables):
    """On a real trace (no device process on the CPU: every process counts) the jitted
    program's events are found, under its module's name; an empty folder is an error naming
    it."""
    f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    a = jnp.ones((64, 64))
    f(a).block_until_ready()
    with jax.profiler.trace(str(tmp_path / "t"), create_perfetto_trace=True):
        f(a).block_until_ready()
    rows = timing.trace_summary(tmp_path / "t", top=1000)
    assert rows and all(r["total_us"] >= 0 and r["count"] >= 1 for r in rows)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    # the profiler names each XLA op's program: the module kept with the kernels
    assert any(r["module"] == "jit__lambda" for r in rows), {r["module"] for r in rows}
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="empty"):
        timing.trace_summary(tmp_path / "empty")


class FakeClock:
    """Stands in for the time module kernels.timing reads perf_counter from: the time moves only
    when a CountingFn runs, by exactly its dt, whatever the machine's load."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(timing, "time", fake)
    return fake


class CountingFn:
    """A plain Python fn standing in for a jitted one: counts its calls, advances the fake clock
    by `dt` seconds in each (dt a power of two: the sums and quotients below are exact), returns a
    ready jnp array."""

    def __init__(self, clock, dt: float = 0.0):
        self.clock, self.dt, self.calls, self.out = clock, dt, 0, jnp.zeros(())

    def __call__(self):
        self.calls += 1
        self.clock.now += self.dt
        return self.out


def test_median_seconds_divides_each_sample_by_its_calls(clock):
    """calls=k: fn runs warmup + iters * k times and each sample is its k calls' time / k: exactly
    one call's dt (an undivided sample would read 10 dt; a warm-up call counted, 11 dt)."""
    dt = 2.0 ** -9
    fn = CountingFn(clock, dt)
    median, times = timing.median_seconds(fn, warmup=2, iters=3, calls=10)
    assert fn.calls == 2 + 3 * 10
    assert times == [dt, dt, dt] and median == dt


def test_median_seconds_one_call_per_sample_by_default(clock):
    """The default times one call per sample (warmup + iters calls), as before."""
    dt = 2.0 ** -9
    fn = CountingFn(clock, dt)
    _, times = timing.median_seconds(fn, warmup=1, iters=4)
    assert fn.calls == 1 + 4 and times == [dt] * 4
    with pytest.raises(ValueError, match="calls"):
        timing.median_seconds(fn, calls=0)


def test_calls_for_clamps_the_target_over_one_call():
    """ceil(target / one call) within [1, max_calls]; a call of no measurable time gets max."""
    assert timing.calls_for(0.001, target_sample_s=0.02, max_calls=256) == 20
    assert timing.calls_for(0.003, target_sample_s=0.02, max_calls=256) == math.ceil(0.02 / 0.003)
    assert timing.calls_for(0.5, target_sample_s=0.02, max_calls=256) == 1
    assert timing.calls_for(1e-7, target_sample_s=0.02, max_calls=256) == 256
    assert timing.calls_for(0.0, max_calls=7) == 7


def test_auto_calls_pick_more_for_a_faster_fn(clock):
    """calls=None: 2 more calls pick the count (calls_per_sample: ceil(target / the second call's
    time) within [1, max_calls]), then iters samples of it. For a 20 ms target: a 2^-6 s call gets
    ceil(1.28) = 2, a 2^-10 s call ceil(20.48) = 21 (timing both calls would give 1 and 11), a
    2^-12 s call the cap of 64 (ceil(81.92) = 82), a call of no time the cap too."""
    for dt, want in ((2.0 ** -6, 2), (2.0 ** -10, 21), (2.0 ** -12, 64), (0.0, 64)):
        fn = CountingFn(clock, dt)
        assert timing.calls_per_sample(fn, target_sample_s=0.02, max_calls=64) == want, dt
        assert fn.calls == 2
    dt = 2.0 ** -10
    for target, max_calls, calls in ((0.02, 64, 21), (1.0, 4, 4)):   # 1 s: 1024 calls, capped
        fn = CountingFn(clock, dt)
        _, times = timing.median_seconds(fn, warmup=1, iters=3, calls=None, target_sample_s=target,
                                         max_calls=max_calls)
        assert fn.calls == 1 + 2 + 3 * calls and times == [dt] * 3


def test_copy_bandwidth_is_the_bytes_of_a_copy_over_the_best_sample(monkeypatch):
    """Known answer: read + write of num_mib MiB (2 x 2 MiB here) over the best (smallest) of
    median_seconds' per-call samples, not their median; repeats and calls passed on; the timed fn
    is a chain of copies (a + 1 of the previous result)."""
    seen = {}

    def fake_median_seconds(fn, *args, warmup, iters, calls, target_sample_s, max_calls):
        seen.update(iters=iters, calls=calls, last=[float(fn()[-1]) for _ in range(2)])
        return 0.003, [0.004, 0.002, 0.003]

    monkeypatch.setattr(timing, "median_seconds", fake_median_seconds)
    got = timing.copy_bandwidth(2, repeats=3, calls=5)
    assert got == pytest.approx(2 * 2 * 2**20 / 0.002, rel=1e-12)   # 2.097152e9 bytes/s
    n = 2 * 2**20 // 4                                                 # float32 elements
    assert seen == {"iters": 3, "calls": 5, "last": [n - 1 + 1.0, n - 1 + 2.0]}


def test_copy_bandwidth_is_a_positive_rate_on_the_cpu():
    """A small copy, automatic and fixed calls per sample: a finite, positive bytes/s."""
    for calls in (None, 3):
        got = timing.copy_bandwidth(1, repeats=2, calls=calls)
        assert math.isfinite(got) and got > 0


def test_abstract_like_keeps_or_replaces_the_placement():
    """abstract_like: arrays become ShapeDtypeStructs of their own sharding; with a sharding,
    arrays and ShapeDtypeStructs alike become ones placed by it; other leaves stay."""
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding
    x = jnp.ones((2, 3), jnp.bfloat16)
    spec = jax.ShapeDtypeStruct((4,), jnp.int32)
    tree = {"x": x, "spec": spec, "n": 3}
    own = timing.abstract_like(tree)
    assert isinstance(own["x"], jax.ShapeDtypeStruct) and own["x"].sharding == x.sharding
    assert (own["x"].shape, own["x"].dtype) == ((2, 3), jnp.bfloat16)
    assert own["spec"] is spec and own["n"] == 3
    where = SingleDeviceSharding(jax.devices()[-1])
    placed = timing.abstract_like(tree, where)
    assert placed["x"].sharding == where and placed["spec"].sharding == where
    assert (placed["spec"].shape, placed["spec"].dtype) == ((4,), jnp.int32) and placed["n"] == 3
