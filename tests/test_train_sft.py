"""The SFT step (delta_jax/train/sft.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from delta_jax import models
from delta_jax.train import sft, state as state_lib


def _tiny():
    cfg = models.get_preset("tiny").replace(vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_layers=2, num_heads=2, num_kv_heads=1,
                                            head_dim=16)
    graphdef, params, rest = state_lib.split_model(models.Transformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, 64, (2, 9)), jnp.int32)
    loss_mask = np.zeros((2, 9), np.float32)
    loss_mask[:, 4:] = 1.0
    batch = {"input_ids": ids, "attention_mask": jnp.ones((2, 9), jnp.int32),
             "loss_mask": jnp.asarray(loss_mask)}
    return graphdef, params, rest, batch


def test_sft_step_logs_the_learning_rate_of_its_own_update():
    """Step k logs schedule(k), the rate its update used (as train/step.py does), not the next
    step's rate. With plain SGD the update is -lr * grad, so the rate actually applied is read
    off the parameters and must equal the logged one."""
    graphdef, params, rest, batch = _tiny()
    schedule = optax.linear_schedule(1e-2, 0.0, 4)   # 1e-2, 7.5e-3, 5e-3, ...: every step differs
    opt = optax.sgd(schedule)
    step_fn = sft.make_sft_step(graphdef, rest, opt, schedule, chunk_size=4)
    grad_fn = jax.jit(jax.grad(
        lambda p: sft.sft_loss(nnx.merge(graphdef, p, rest), batch, 4)[0]))

    st = state_lib.init_train_state(jax.tree.map(jnp.copy, params), opt)
    for k in range(3):
        before = jax.tree.map(jnp.copy, st.params)
        grads = grad_fn(before)
        st, metrics = step_fn(st, batch)
        assert int(metrics["sft/skipped"]) == 0 and int(st.step) == k + 1
        logged = float(metrics["sft/learning_rate"])
        np.testing.assert_allclose(logged, float(schedule(k)), rtol=1e-6)
        # The rate the update applied: (before - after) / grad on the largest-gradient entry.
        g, b, a = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
                   for t in (grads, before, st.params))
        i = int(np.argmax(np.abs(g)))
        np.testing.assert_allclose((b[i] - a[i]) / g[i], logged, rtol=1e-3)


def test_micro_batched_sft_step_takes_the_whole_batchs_token_mean_gradient():
    """sft.micro_batch_size=2 over 4 rows with 5, 1, 3 and 4 target tokens: the update (plain
    SGD, so -lr x gradient), loss and token count are the whole batch's token mean, as
    jax.grad of sft_loss over all 4 rows gives them (not the mean of the two halves' means,
    which differs here); a micro-batch size that does not divide the batch is refused naming
    sft.micro_batch_size."""
    import pytest

    graphdef, params, rest, _ = _tiny()
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(3, 64, (4, 9)), jnp.int32)
    loss_mask = np.zeros((4, 9), np.float32)
    for row, start in enumerate((4, 8, 6, 5)):
        loss_mask[row, start:] = 1.0
    batch = {"input_ids": ids, "attention_mask": jnp.ones((4, 9), jnp.int32),
             "loss_mask": jnp.asarray(loss_mask)}
    lr = 0.5
    opt = optax.sgd(lr)

    def loss(p, b):
        return sft.sft_loss(nnx.merge(graphdef, p, rest), b, 4)

    want_loss, want_count = loss(params, batch)
    want_grads = jax.grad(lambda p: loss(p, batch)[0])(params)
    halves = [jax.tree.map(lambda x: x[i:i + 2], batch) for i in (0, 2)]
    mean_of_means = sum(float(loss(params, h)[0]) for h in halves) / 2
    assert abs(mean_of_means - float(want_loss)) > 1e-3  # the two differ on this batch

    step_fn = sft.make_sft_step(graphdef, rest, opt, chunk_size=4, micro_batch_size=2)
    st, metrics = step_fn(state_lib.init_train_state(jax.tree.map(jnp.copy, params), opt), batch)
    assert int(metrics["sft/skipped"]) == 0 and float(metrics["sft/tokens"]) == 13.0
    np.testing.assert_allclose(float(metrics["sft/loss"]), float(want_loss), rtol=1e-6)
    assert float(want_count) == 13.0
    for new, old, g in zip(jax.tree.leaves(st.params), jax.tree.leaves(params),
                           jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(old) - np.asarray(new), lr * np.asarray(g),
                                   rtol=1e-4, atol=1e-7)
    bad = sft.make_sft_step(graphdef, rest, opt, chunk_size=4, micro_batch_size=3)
    with pytest.raises(ValueError, match=r"sft\.micro_batch_size=3 does not divide the batch "
                                         r"of 4 rows"):
        bad(state_lib.init_train_state(jax.tree.map(jnp.copy, params), opt), batch)


class _CharTokenizer:
    """One token per character (its code point); pad 0, EOS 1."""
    pad_token_id, eos_token_id = 0, 1

    def encode(self, text):
        return [ord(c) for c in text]


def test_tokenize_examples_masks_the_target_and_counts_what_max_len_cuts():
    """The loss mask covers solution + EOS only; a row longer than max_len keeps its first
    max_len tokens (counted in num_truncated); a row whose prompt alone fills max_len has no
    target token left and is left out (num_dropped; the loop warns), and when that is every
    row the error names sft.max_len (before, such rows trained on nothing at loss 0)."""
    import pytest

    tok, template = _CharTokenizer(), (lambda problem: problem + ":")
    recs = [{"problem": "ab", "solution": "xy"},      # 3 + 2 + EOS = 6 tokens: fits 7
            {"problem": "abcd", "solution": "xyz"},   # 5 + 3 + EOS = 9: cut to 7
            {"problem": "abcdefg", "solution": "x"},  # the prompt alone is 8: left out
            {"problem": "q", "solution": ""}]         # no solution: not an SFT example
    ex = sft.tokenize_examples(recs, tok, template, max_len=7)
    assert ex.input_ids.shape == (2, 7) and (ex.num_truncated, ex.num_dropped) == (1, 1)
    np.testing.assert_array_equal(ex.input_ids[0], tok.encode("ab:xy") + [1, 0])
    np.testing.assert_array_equal(ex.loss_mask[0], [0, 0, 0, 1, 1, 1, 0])
    np.testing.assert_array_equal(ex.attention_mask[0], [1] * 6 + [0])
    np.testing.assert_array_equal(ex.input_ids[1], tok.encode("abcd:xy"))
    np.testing.assert_array_equal(ex.loss_mask[1], [0] * 5 + [1, 1])
    with pytest.raises(ValueError, match=r"sft.max_len=3 leaves no solution token .* 3 to 8 "
                                         r"tokens; raise sft.max_len"):
        sft.tokenize_examples(recs, tok, template, max_len=3)
