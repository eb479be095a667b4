"""Tests for delta_jax.rl.dynamic_sampling (DAPO group filtering and refill)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.rl.dynamic_sampling import fill_batch_with_signal, group_has_signal


def test_group_has_signal_numpy_and_jit():
    rewards = np.array([[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0], [-1, -1, -1, 1],
                        [0.5, 0.5, 0.5000001, 0.5]], np.float32)
    np.testing.assert_array_equal(group_has_signal(rewards), [False, False, True, True, True])
    np.testing.assert_array_equal(group_has_signal(rewards, atol=1e-3),
                                  [False, False, True, True, False])
    got = jax.jit(group_has_signal)(jnp.asarray(rewards))
    np.testing.assert_array_equal(np.asarray(got), [False, False, True, True, True])
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        group_has_signal(np.zeros(4))


def _fake_generate(kind_of, group_size=4, calls=None):
    """Prompt i gets all-0, all-1 or mixed rewards according to kind_of(i)."""
    def generate_and_score(prompts):
        if calls is not None:
            calls.append(list(prompts))
        rows = []
        for p in prompts:
            kind = kind_of(p)
            rows.append({"zero": [0.0] * group_size, "one": [1.0] * group_size,
                         "mixed": [1.0] + [0.0] * (group_size - 1)}[kind])
        groups = [[f"response {p}.{j}" for j in range(group_size)] for p in prompts]
        return groups, np.array(rows, np.float32)
    return generate_and_score


def _kind(i):
    return ("zero", "one", "mixed")[i % 3]  # one prompt in three has signal


def test_fill_returns_exactly_the_requested_groups():
    calls = []
    out = fill_batch_with_signal(_fake_generate(_kind, calls=calls), itertools.count(),
                                 num_groups=5, prompts_per_round=6)
    # Kept prompts are the mixed ones, in iterator order: 2, 5, 8, 11, 14.
    assert out.prompts == [2, 5, 8, 11, 14]
    assert out.groups[0] == [f"response 2.{j}" for j in range(4)]
    assert out.rewards.shape == (5, 4) and out.rewards.dtype == np.float32
    assert group_has_signal(out.rewards).all()
    # 6 prompts per round, 2 with signal each: 3 rounds, 18 prompts; 12 dropped, 1 surplus (17).
    assert [len(c) for c in calls] == [6, 6, 6]
    s = out.stats
    assert s["rounds"] == 3 and s["prompts_generated"] == 18
    assert s["groups_kept"] == 5 and s["groups_dropped"] == 12 and s["groups_surplus"] == 1
    assert s["groups_padded"] == 0 and not s["prompts_exhausted"]
    assert s["dropped_mean_reward"] == pytest.approx(0.5)  # half all-correct, half all-wrong
    assert s["keep_rate"] == pytest.approx(6 / 18)


def test_no_refill_needed_when_all_groups_have_signal():
    calls = []
    out = fill_batch_with_signal(_fake_generate(lambda i: "mixed", calls=calls), iter(range(100)),
                                 num_groups=8)
    assert out.prompts == list(range(8)) and out.stats["rounds"] == 1 and len(calls) == 1
    assert out.stats["groups_dropped"] == 0


def test_max_rounds_raise_or_pad():
    gen = _fake_generate(lambda i: "zero" if i != 3 else "mixed")
    with pytest.raises(RuntimeError, match="max_rounds=2"):
        fill_batch_with_signal(gen, itertools.count(), num_groups=4, prompts_per_round=4,
                               max_rounds=2)
    with pytest.raises(ValueError, match="on_max_rounds"):
        fill_batch_with_signal(gen, itertools.count(), num_groups=4, on_max_rounds="warn")
    with pytest.warns(RuntimeWarning, match="only 1 of 4 groups.*Padded with 3"):
        out = fill_batch_with_signal(gen, itertools.count(), num_groups=4, prompts_per_round=4,
                                     max_rounds=2, on_max_rounds="pad")
    # The kept group first, then the latest dropped prompts (5, 6, 7) as zero-signal padding.
    assert out.prompts == [3, 5, 6, 7] and out.rewards.shape == (4, 4)
    assert out.stats["groups_kept"] == 1 and out.stats["groups_padded"] == 3
    assert out.stats["keep_rate"] == 1 / 8 and out.stats["groups_dropped"] == 7
    np.testing.assert_array_equal(group_has_signal(out.rewards), [True, False, False, False])
    # Too few dropped groups to pad with (the prompts ran out): an error, never a short batch.
    with pytest.raises(RuntimeError, match=r"prompt iterator ran out.*Too few groups .*\(3\)"):
        fill_batch_with_signal(gen, iter(range(3)), num_groups=4, on_max_rounds="pad")


def test_prompt_iterator_running_out():
    with pytest.raises(RuntimeError, match="prompt iterator ran out"):
        fill_batch_with_signal(_fake_generate(_kind), iter(range(7)), num_groups=3,
                               prompts_per_round=3)


def test_bad_generate_outputs_are_clear_errors():
    def bad_shape(prompts):
        return prompts, np.zeros((len(prompts) + 1, 4))

    def bad_groups(prompts):
        return prompts[:-1], np.zeros((len(prompts), 4))

    with pytest.raises(ValueError, match="rewards of shape"):
        fill_batch_with_signal(bad_shape, itertools.count(), num_groups=2)
    with pytest.raises(ValueError, match="groups for"):
        fill_batch_with_signal(bad_groups, itertools.count(), num_groups=2)
    with pytest.raises(ValueError, match="on_max_rounds"):
        fill_batch_with_signal(bad_groups, itertools.count(), num_groups=2, on_max_rounds="x")
