"""Token filtering / sampling math (delta_jax.sampling_utils) against a NumPy reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from delta_jax import sampling_utils as su


def reference_distribution(logits, temperature, top_k, top_p):
    """Independent NumPy reference of the documented definition, one row [V] -> probs [V] (fp64)."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.lexsort((np.arange(z.size), -z))  # by -z, then by token id
    if top_k != -1:
        order = order[:top_k]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    kept = []
    mass = 0.0
    for token, prob in zip(order, p):
        kept.append(token)
        mass += prob
        if mass >= top_p - 1e-12:
            break
    out = np.zeros(z.size)
    w = np.exp(z[kept] - z[kept].max())
    out[kept] = w / w.sum()
    return out


def kept_log_probs(logits, temperature, top_p, *, top_k, use_top_p):
    """Full-vocabulary log-probs [B, V] (-inf outside the kept set) of the candidates the sampler
    draws from (sampling_utils.filtered_candidates, which sample_tokens runs), for comparing
    with the reference; the sampler itself never builds this."""
    values, ids = su.filtered_candidates(jnp.asarray(logits), temperature, top_p, top_k=top_k,
                                         use_top_p=use_top_p)
    logp = np.asarray(jax.nn.log_softmax(values, axis=-1))
    if ids is None:
        return logp
    full = np.full(np.shape(logits), -np.inf, np.float32)
    np.put_along_axis(full, np.asarray(ids), logp, axis=-1)
    return full


def _draw(logits_row, temperature, top_p, top_k, num_draws, seed=0):
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (num_draws, len(logits_row)))
    keys = jax.random.split(jax.random.key(seed), num_draws)
    params = su.SamplingParams(temperature, top_p, top_k)
    fn = jax.jit(lambda k, l: su.sample_tokens(
        k, l, temperature, top_p, top_k=params.effective_top_k(len(logits_row)),
        use_top_p=params.use_top_p, greedy=params.greedy))
    return [np.asarray(x) for x in fn(keys, logits)]


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, -1, 1.0), (0.7, -1, 0.8), (1.3, 5, 1.0), (1.0, 6, 0.7), (0.5, 3, 0.95), (2.0, -1, 0.3)],
)
def test_filtered_log_probs_match_reference(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 11)).astype(np.float32) * 2
    logits[1, [2, 5, 7]] = logits[1].max()  # ties at the top
    logits[2, :] = 0.5  # all tied
    logits[3, [0, 9]] = logits[3, 4]  # ties somewhere in the middle
    params = su.SamplingParams(temperature, top_p, top_k)
    got = np.exp(kept_log_probs(logits, temperature, top_p, top_k=params.effective_top_k(11),
                                use_top_p=params.use_top_p))
    for row in range(4):
        want = reference_distribution(logits[row], temperature, top_k, top_p)
        np.testing.assert_allclose(got[row], want, atol=1e-6)
        assert set(np.nonzero(got[row])[0]) == set(np.nonzero(want)[0])


def test_ties_are_broken_by_token_id():
    logits = jnp.asarray([[1.0, 3.0, 3.0, 3.0, 0.0]])
    kept = np.isfinite(kept_log_probs(logits, 1.0, 1.0, top_k=2, use_top_p=False))
    assert kept.tolist() == [[False, True, True, False, False]]
    # Full-sort path (top-p only): equal probabilities, the lower ids come first.
    flat = jnp.zeros((1, 4))
    kept = np.isfinite(kept_log_probs(flat, 1.0, 0.5, top_k=-1, use_top_p=True))
    assert kept.tolist() == [[True, True, False, False]]
    tokens, _, _ = su.sample_tokens(jax.random.split(jax.random.key(0), 1), logits, 0.0, 1.0,
                                    top_k=-1, use_top_p=False, greedy=True)
    assert int(tokens[0]) == 1


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = jnp.log(jnp.asarray([[0.5, 0.25, 0.125, 0.125]]))

    def support(p):
        logp = kept_log_probs(logits, 1.0, p, top_k=-1, use_top_p=True)
        return np.nonzero(np.isfinite(logp[0]))[0].tolist()

    assert support(0.3) == [0]
    assert support(0.5) == [0]          # first token alone already has mass 0.5 >= 0.5
    assert support(0.6) == [0, 1]
    assert support(0.8) == [0, 1, 2]
    assert support(1e-9) == [0]         # always at least one token


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 0.8), (0.8, 4, 1.0), (1.5, 5, 0.9)])
def test_empirical_frequencies_match_filtered_distribution(temperature, top_k, top_p):
    logits = np.asarray([2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -0.5, -1.0], np.float32)
    num_draws = 20000
    tokens, logp, tempered_logp = _draw(logits, temperature, top_p, top_k, num_draws)
    want = reference_distribution(logits, temperature, top_k, top_p)
    support = want > 0
    assert support.sum() >= 3 and (~support).sum() >= 1  # the filter really removes something
    counts = np.bincount(tokens, minlength=logits.size)
    assert counts[~support].sum() == 0  # nothing outside the kept set, ever
    threshold = stats.chi2.ppf(0.999, df=support.sum() - 1)
    chi2 = (((counts - num_draws * want) ** 2)[support] / (num_draws * want[support])).sum()
    assert chi2 < threshold
    # The same test must reject a wrong expectation: the unfiltered tempered distribution.
    unfiltered = reference_distribution(logits, temperature, -1, 1.0)
    chi2_wrong = ((counts - num_draws * unfiltered) ** 2 / (num_draws * unfiltered)).sum()
    assert chi2_wrong > stats.chi2.ppf(0.999, df=logits.size - 1)
    # Returned log-probs are those of the drawn tokens under both distributions.
    np.testing.assert_allclose(np.exp(logp), want[tokens], rtol=1e-5)
    np.testing.assert_allclose(np.exp(tempered_logp), unfiltered[tokens], rtol=1e-5)


def test_unfiltered_sampling_matches_tempered_softmax():
    logits = np.asarray([1.0, 0.5, 0.0, -0.5, -2.0], np.float32)
    num_draws = 20000
    tokens, logp, tempered_logp = _draw(logits, 0.6, 1.0, -1, num_draws, seed=3)
    want = reference_distribution(logits, 0.6, -1, 1.0)
    counts = np.bincount(tokens, minlength=logits.size)
    chi2 = ((counts - num_draws * want) ** 2 / (num_draws * want)).sum()
    assert chi2 < stats.chi2.ppf(0.999, df=logits.size - 1)
    # Both returned log-probs are the drawn tokens' under the tempered softmax (nothing filtered).
    np.testing.assert_allclose(np.exp(logp), want[tokens], rtol=1e-5)
    np.testing.assert_allclose(np.exp(tempered_logp), want[tokens], rtol=1e-5)
    # At T = 1 the frequencies would be visibly different: the test has power.
    wrong = reference_distribution(logits, 1.0, -1, 1.0)
    assert ((counts - num_draws * wrong) ** 2 / (num_draws * wrong)).sum() > 100


def test_greedy_log_probs_use_unit_temperature():
    logits = jnp.asarray([[0.1, 2.0, -1.0], [3.0, 3.0, 0.0]])
    tokens, logp, tempered = su.sample_tokens(jax.random.split(jax.random.key(0), 2), logits, 0.0,
                                              1.0, top_k=-1, use_top_p=False, greedy=True)
    assert tokens.tolist() == [1, 0]
    want = jax.nn.log_softmax(logits)[jnp.arange(2), tokens]
    np.testing.assert_allclose(logp, want, atol=1e-6)
    np.testing.assert_allclose(tempered, want, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,name",
    [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"),
     ({"top_k": -2}, "top_k"), ({"top_k": 2.0}, "top_k")],
)
def test_invalid_parameters_name_the_argument(kwargs, name):
    args = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, **kwargs}
    with pytest.raises(ValueError, match=name):
        su.SamplingParams(**args)


def test_effective_top_k_disables_when_not_filtering():
    assert su.SamplingParams(1.0, 1.0, 50).effective_top_k(50) == -1
    assert su.SamplingParams(1.0, 1.0, 49).effective_top_k(50) == 49
    assert not su.SamplingParams(1.0, 1.0, -1).use_top_p


@pytest.mark.parametrize("size,max_slabs", [(300, 1024), (320, 1024), (300, 1)])
def test_categorical_draws_softmax_over_slabs_and_blocks(size, max_slabs):
    """su.categorical (the sampler's draw: inverse CDF over slabs, blocks and candidates) against
    softmax(values) by a chi-square test: 300 candidates make 4 slabs of 75 in blocks of 9 (the
    last block padded), 320 make 64 slabs of 5 in blocks of 3, and one slab of 300 is blocks of 18,
    so every level chooses; excluded (-inf) candidates, including whole slabs and blocks, are
    never drawn; the same counts reject a slightly tilted softmax. Each draw's log-probability is
    log softmax(values) at the drawn candidate (float64 reference)."""
    rng = np.random.default_rng(1)
    values = rng.normal(size=size).astype(np.float32)
    values[[0, 17, 150, size - 1]] = -np.inf
    values[32:48] = -np.inf
    num_draws = 60000
    keys = jax.random.split(jax.random.key(5), num_draws)
    rows = jnp.broadcast_to(jnp.asarray(values), (num_draws, values.size))
    tokens, logp = jax.jit(lambda k, v: su.categorical(k, v, max_slabs=max_slabs))(keys, rows)
    tokens = np.asarray(tokens)
    counts = np.bincount(tokens, minlength=values.size)
    p = np.exp(values.astype(np.float64) - values[np.isfinite(values)].max())
    p /= p.sum()
    np.testing.assert_allclose(np.asarray(logp), np.log(p[tokens]), rtol=0, atol=2e-6)
    support = p > 0
    assert counts[~support].sum() == 0
    chi2 = (((counts - num_draws * p) ** 2)[support] / (num_draws * p[support])).sum()
    assert chi2 < stats.chi2.ppf(0.999, df=support.sum() - 1), chi2
    tilted = p * np.exp(0.3 * np.arange(values.size) / values.size)    # last / first: 1.35
    tilted /= tilted.sum()
    wrong = (((counts - num_draws * tilted) ** 2)[support] / (num_draws * tilted[support])).sum()
    assert wrong > stats.chi2.ppf(0.999, df=support.sum() - 1), wrong


def test_categorical_edge_rows():
    """A row with one finite candidate always draws it (wherever it sits: first, last, alone in
    its block, at a slab's edge); a row of equal values draws every candidate; rows are
    independent of their batch neighbours (each draws from its own key)."""
    keys = jax.random.split(jax.random.key(0), 6)
    one = np.full((6, 70), -np.inf, np.float32)                # 2 slabs of 35, blocks of 6
    spots = [0, 69, 16, 34, 35, 64]
    for row, spot in enumerate(spots):
        one[row, spot] = 1.0
    tokens, logp = su.categorical(keys, jnp.asarray(one))
    assert np.asarray(tokens).tolist() == spots
    assert np.asarray(logp).tolist() == [0.0] * 6                # log 1, exactly
    flat, logp = su.categorical(jax.random.split(jax.random.key(1), 4000), jnp.zeros((4000, 70)))
    assert set(np.asarray(flat).tolist()) == set(range(70))
    np.testing.assert_allclose(np.asarray(logp), -np.log(70), rtol=1e-6)
    values = jax.random.normal(jax.random.key(2), (6, 70))
    alone = [int(su.categorical(keys[i:i + 1], values[i:i + 1])[0][0]) for i in range(6)]
    assert np.asarray(su.categorical(keys, values)[0]).tolist() == alone


@pytest.mark.devices(4)
def test_categorical_keeps_a_vocabulary_split_over_devices_local():
    """Logits whose vocabulary is split over a "tensor" mesh axis (4 devices, the Qwen3
    vocabulary): the compiled draw's collectives move the slab masses and one slab a row, never
    the row (a layout that cut the row across the devices' parts gathered 77,824 values a row)."""
    import re

    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("tensor",))
    rows, vocab = 16, 151936
    values = jax.ShapeDtypeStruct((rows, vocab), jnp.float32,
                                  sharding=NamedSharding(mesh, PartitionSpec(None, "tensor")))
    keys = jax.ShapeDtypeStruct((rows,), jax.random.key(0).dtype,
                                sharding=NamedSharding(mesh, PartitionSpec()))
    text = jax.jit(su.categorical).lower(keys, values).compile().as_text()
    moved = [int(np.prod([int(d) for d in m.group(1).split(",") if d]))
             for m in re.finditer(r"= \w+\[([\d,]*)\][^=]*? (?:all-gather|all-reduce|"
                                  r"all-to-all|collective-permute)\(", text)]
    assert moved and max(moved) <= rows * 1187, sorted(moved)[-3:]   # 128 slabs of 1,187


def test_pick_falls_back_to_the_last_positive_weight():
    """_pick's guard: a target at or past the total (u * total rounding up) returns the last index
    of positive weight, never a zero-weight index after it; u = 0 returns the first positive one."""
    weights = jnp.asarray([[0.0, 1.0, 2.0, 0.0, 0.0], [0.0, 0.0, 3.0, 1.0, 0.0]])
    assert su._pick(weights, jnp.asarray([1.0, 1.0])).tolist() == [2, 3]
    assert su._pick(weights, jnp.asarray([0.0, 0.0])).tolist() == [1, 2]
    assert su._pick(weights, jnp.asarray([0.4, 0.8])).tolist() == [2, 3]
