"""Eager (un-jitted) calls must not recompile: a 2nd and 3rd call of one shape compile nothing.

Compilations are counted with a `jax.monitoring` listener on XLA's backend-compile event,
which fires once per executable built (jitted functions and single primitives run eagerly
alike). A call that closes over new Python functions (e.g. lambdas handed to `lax.cond`)
gives jax new jaxprs, misses its caches and builds a new executable every time.
"""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import geoparam
from geoparam import hyperspherical as hs
from geoparam import lcw

_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'


@contextlib.contextmanager
def _compiles():
  """Yields a list that collects the name of every function XLA compiles inside the block."""
  names = []

  def listener(event, duration, **kwargs):
    del duration
    if event == _COMPILE_EVENT:
      names.append(kwargs.get('fun_name', '?'))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _compiles_per_call(fn, args_per_call):
  """Names compiled by each call `fn(*args)` (results blocked on), one list per call."""
  counts = []
  for args in args_per_call:
    with _compiles() as names:
      jax.block_until_ready(fn(*args))
    counts.append(names)
  return counts


def _assert_warm_calls_compile_nothing(fn, args_per_call):
  counts = _compiles_per_call(fn, args_per_call)
  assert counts[1:] == [[]] * (len(counts) - 1), (
      f'eager calls after the first compiled again: {counts[1:]} (first call: {counts[0]})')


def test_the_counter_sees_compilations():
  # Guards the listener itself (an event renamed upstream would make every test below pass).
  f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
  x = jnp.ones((7, 13))
  with _compiles() as names:
    f(x).block_until_ready()
  assert names == ['jit(<lambda>)'], names
  with _compiles() as names:  # an eager primitive is an executable too
    jnp.cbrt(x).block_until_ready()
  assert names == ['jit(cbrt)'], names


def _thetas(shape, dtype=jnp.float32, calls=3):
  """Different values of one shape for each call (created before counting)."""
  rng = np.random.default_rng(sum(shape))
  return [jnp.asarray(rng.uniform(-1.0, 4.0, size=shape), dtype) for _ in range(calls)]


_GRAD_TARGET = jnp.asarray(np.random.default_rng(0).normal(size=(24, 5)), jnp.float32)


def _sum_weighted(u):
  return jnp.sum(u * _GRAD_TARGET[: u.shape[0], : u.shape[1]])


FUNCTIONS = {
    'to_cartesian_batched': lambda t: hs.to_cartesian_batched(t),
    'to_cartesian_batched_associative': lambda t: hs.to_cartesian_batched(t, 'associative'),
    'to_cartesian': lambda t: hs.to_cartesian(t[:, 0]),
    'sincos': hs.sincos,
    'prefix_product': hs.prefix_product,
    'suffix_affine': lambda t: hs.suffix_affine(t, jnp.cos(t)),
    'project_batched': lcw.project_batched,
    'grad to_cartesian_batched': jax.grad(lambda t: _sum_weighted(hs.to_cartesian_batched(t))),
    'grad to_cartesian_batched associative': jax.grad(
        lambda t: _sum_weighted(hs.to_cartesian_batched(t, 'associative'))),
    'grad to_cartesian': jax.grad(lambda t: jnp.sum(hs.to_cartesian(t[:, 0]) ** 3)),
    'grad sincos': jax.grad(lambda t: jnp.sum(hs.sincos(t)[0] * hs.sincos(t)[1] ** 2)),
    'grad prefix_product': jax.grad(lambda t: jnp.sum(hs.prefix_product(t))),
    'grad suffix_affine': jax.grad(lambda t: jnp.sum(hs.suffix_affine(t, t * 0.5))),
    'grad project_batched': jax.grad(lambda t: _sum_weighted(lcw.project_batched(t) ** 2)),
}


@pytest.mark.parametrize('name', list(FUNCTIONS))
def test_eager_functions_compile_once(name):
  # The thetas are created (and their creation compiled) outside the counted calls.
  thetas = _thetas((17, 5))
  _assert_warm_calls_compile_nothing(FUNCTIONS[name], [(t,) for t in thetas])


@pytest.mark.parametrize('name', ['to_cartesian_batched', 'grad to_cartesian_batched', 'sincos'])
def test_eager_functions_compile_once_float64(x64, name):
  thetas = _thetas((9, 3), jnp.float64)
  _assert_warm_calls_compile_nothing(FUNCTIONS[name], [(t,) for t in thetas])


def test_eager_sincos_beyond_the_polynomial_range_compiles_once():
  # The other branch of the range test (some |x| > 8192): still one executable.
  thetas = [t.at[0, 0].set(1e5) for t in _thetas((6, 4))]
  _assert_warm_calls_compile_nothing(hs.sincos, [(t,) for t in thetas])
  _assert_warm_calls_compile_nothing(hs.to_cartesian_batched, [(t,) for t in thetas])


def test_eager_map_equals_jitted_map():
  theta = _thetas((33, 4), calls=1)[0]
  np.testing.assert_array_equal(hs.to_cartesian_batched(theta),
                                jax.jit(hs.to_cartesian_batched)(theta))
  g = jnp.ones((34, 4))
  grad = jax.grad(lambda t: jnp.sum(hs.to_cartesian_batched(t) * g))
  np.testing.assert_array_equal(grad(theta), jax.jit(grad)(theta))


LAYERS = {
    'GmPDense': (lambda: geoparam.GmPDense(6), (4, 9)),
    'GmPConv': (lambda: geoparam.GmPConv(6, (3, 3)), (2, 5, 5, 3)),
    'LCWDense': (lambda: geoparam.LCWDense(6), (4, 9)),
    'LCWConv': (lambda: geoparam.LCWConv(6, (3, 3)), (2, 5, 5, 3)),
    'CWNDense': (lambda: geoparam.CWNDense(6), (4, 9)),
    'GmP(Dense)+IMN': (lambda: geoparam.GmP(nn.Dense(6), input_mean_norm=True,
                                            use_running_average=True), (4, 9)),
    'GmP(Conv)': (lambda: geoparam.GmP(nn.Conv(6, (3, 3))), (2, 5, 5, 3)),
    'LCW(Dense)': (lambda: geoparam.LCW(nn.Dense(6)), (4, 9)),
    'CWN(Conv)': (lambda: geoparam.CWN(nn.Conv(6, (3, 3))), (2, 5, 5, 3)),
    'WN(Dense)': (lambda: geoparam.WN(nn.Dense(6)), (4, 9)),
    'reparameterize(gmp_imn)': (
        lambda: geoparam.reparameterize(nn.Sequential([nn.Dense(6), nn.relu, nn.Dense(2)]),
                                        'gmp_imn'), (4, 9)),
}


@pytest.mark.parametrize('name', list(LAYERS))
def test_eager_layers_init_and_apply_compile_once(name):
  make, shape = LAYERS[name]
  layer = make()
  keys = [jax.random.key(i) for i in range(3)]
  xs = [jnp.full(shape, float(i + 1)) for i in range(3)]
  counts = _compiles_per_call(layer.init, [(k, x) for k, x in zip(keys, xs)])
  assert counts[1:] == [[], []], f'{name}.init compiled again: {counts[1:]}'
  variables = layer.init(keys[0], xs[0])
  counts = _compiles_per_call(layer.apply, [(variables, x) for x in xs])
  assert counts[1:] == [[], []], f'{name}.apply compiled again: {counts[1:]}'


def test_eager_gmp_dense_new_parameter_values_compile_nothing():
  layer = geoparam.GmPDense(8)
  x = jnp.ones((3, 5))
  variables = layer.init(jax.random.key(0), x)
  other = jax.tree.map(lambda v: v + 0.25, variables)
  counts = _compiles_per_call(layer.apply, [(variables, x), (other, x), (variables, x + 1)])
  assert counts[1:] == [[], []], counts


@pytest.mark.parametrize('name', ['GmPLinear+IMN', 'GmP(Conv)', 'LCW(Linear)'])
def test_nnx_modules_eager_calls_compile_once(name):
  from flax import nnx
  import geoparam.nnx as gnnx
  make = {
      'GmPLinear+IMN': lambda: gnnx.GmPLinear(5, 4, input_mean_norm=True, rngs=nnx.Rngs(0)),
      'GmP(Conv)': lambda: gnnx.GmP(nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1)),
      'LCW(Linear)': lambda: gnnx.LCW(nnx.Linear(5, 4, rngs=nnx.Rngs(0))),
  }[name]
  module = make()
  shape = (2, 6, 6, 3) if 'Conv' in name else (3, 5)
  xs = [(jax.random.normal(jax.random.key(i), shape),) for i in range(3)]
  _assert_warm_calls_compile_nothing(module, xs)  # training mode: updates the running mean
  module.eval()
  _assert_warm_calls_compile_nothing(module, xs)
