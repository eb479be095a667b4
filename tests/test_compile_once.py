"""tests/compile_once.py, the suite's in-memory executable cache (installed by conftest.py on
the CPU): a program compiled again is given the executable compiled before, and only a program
with the same module, options and devices is; one with host callbacks is always compiled."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import compile_once

pytestmark = pytest.mark.cpu


@pytest.fixture(autouse=True)
def installed():
  assert compile_once.install()


def _counts():
  return dict(compile_once.stats)


def _delta(before):
  return {k: compile_once.stats[k] - before[k] for k in before}


def test_the_same_program_of_a_new_function_is_compiled_once():
  def make(scale):  # a new Python function each call, as each build_run's train step is
    return jax.jit(lambda x: jnp.tanh(x) * scale + 0.123456)
  x = jnp.arange(8, dtype=jnp.float32)
  before = _counts()
  first = make(3.0).lower(x).compile()
  second = make(3.0).lower(x).compile()
  assert _delta(before) == {"hits": 1, "misses": 1, "uncached": 0}
  np.testing.assert_array_equal(np.asarray(second(x)), np.asarray(first(x)))
  np.testing.assert_allclose(np.asarray(second(x)), np.tanh(np.arange(8)) * 3 + 0.123456,
                             rtol=1e-6)
  x9 = jnp.arange(9, dtype=jnp.float32)
  before = _counts()
  other = make(4.0).lower(x).compile()  # another constant: another program
  wider = make(3.0).lower(x9).compile()  # another shape
  donated = jax.jit(lambda x: jnp.tanh(x) * 3.0 + 0.123456, donate_argnums=0).lower(x).compile()
  assert _delta(before) == {"hits": 0, "misses": 3, "uncached": 0}
  np.testing.assert_allclose(np.asarray(other(x)), np.tanh(np.arange(8)) * 4 + 0.123456,
                             rtol=1e-6)
  assert wider(x9).shape == (9,)
  assert donated(jnp.ones(8)).shape == (8,)


def test_another_device_gets_its_own_executable():
  cpus = jax.devices("cpu")
  assert len(cpus) >= 2
  f = lambda x: x * 2.0 + 0.654321  # noqa: E731
  x0, x1 = jax.device_put(np.ones(4, np.float32), cpus[0]), jax.device_put(
      np.ones(4, np.float32), cpus[1])
  before = _counts()
  on0 = jax.jit(f)(x0)
  on1 = jax.jit(f)(x1)
  assert _delta(before)["misses"] == 2 and _delta(before)["hits"] == 0
  assert on0.devices() == {cpus[0]} and on1.devices() == {cpus[1]}
  np.testing.assert_array_equal(np.asarray(on1), np.full(4, 2.654321, np.float32))


def test_a_program_with_host_callbacks_is_always_compiled():
  seen = []

  def make(tag):
    def f(x):
      jax.debug.callback(lambda v: seen.append((tag, float(v.sum()))), x)
      return x + 1.0
    return jax.jit(f)
  x = jnp.ones(3)
  before = _counts()
  make("a")(x).block_until_ready()
  make("b")(x).block_until_ready()
  jax.effects_barrier()
  got = _delta(before)  # (jax.effects_barrier may compile a program of its own)
  assert got["hits"] == 0 and got["uncached"] == 2, got
  assert seen == [("a", 3.0), ("b", 3.0)]  # each program calls its own callback


def test_clear_drops_the_executables():
  x = jnp.ones(5)
  jax.jit(lambda x: x - 0.987654).lower(x).compile()
  compile_once.clear()
  before = _counts()
  jax.jit(lambda x: x - 0.987654).lower(x).compile()  # a new function: JAX's caches miss
  assert _delta(before) == {"hits": 0, "misses": 1, "uncached": 0}
