"""sampling.progress: the throttled progress lines of long generate() calls."""
import logging

from delta_jax.sampling.progress import ProgressLog, format_progress


def _info(seconds, finished=3, tokens=1_500_000, steps=400):
    return {"finished": finished, "samples": 2048, "generated_tokens": tokens,
            "decode_steps": steps, "seconds": seconds}


def test_format_progress():
    assert format_progress("rollout step 3", _info(120.0, 812, 4_116_000, 3840)) == (
        "rollout step 3: 812 / 2,048 samples done, 4.12 M tokens in 120 s (34,300 tok/s), "
        "3,840 decode steps")


def _lines(caplog):
    lines = [r.getMessage() for r in caplog.records if r.name == "delta_jax.sampling"]
    caplog.clear()
    return lines


def test_lines_every_interval_none_in_the_first_and_again_per_call(caplog):
    caplog.set_level(logging.INFO, logger="delta_jax.sampling")
    progress = ProgressLog("eval step 0", 60.0)
    for seconds in (1, 30, 59.9, 60.0, 61, 119, 130, 250):  # one call's decode calls
        progress(_info(seconds))
    lines = _lines(caplog)
    assert [line.split(" in ")[1].split(" s ")[0] for line in lines] == ["60", "130", "250"]
    assert lines[0] == format_progress("eval step 0", _info(60.0))
    for seconds in (2, 50, 70):  # the next generate() call: its clock starts again
        progress(_info(seconds))
    lines = _lines(caplog)
    assert len(lines) == 1 and " in 70 s " in lines[0]
    # A tiny interval (a line at every decode call) costs nothing either (the next due time
    # came from a loop of 1e-9 steps: 0.8 s a call at 10^8 of them).
    tiny = ProgressLog("x", 1e-9)
    for seconds in (1e8 * 1e-9 * 1e3, 200.0, 300.0):
        tiny(_info(seconds))
    assert len(_lines(caplog)) == 3
    off = ProgressLog("x", 0.0)
    off(_info(1e6))
    assert _lines(caplog) == []
