"""The native CPU map (`geoparam.native`): built where a compiler is, equal to the XLA scans,
differentiable twice, and a clean fallback where it cannot be built."""

import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geoparam import hyperspherical as hs
from geoparam import native

_COMPILER = shutil.which(os.environ.get('CXX') or 'c++')
needs_native = pytest.mark.skipif(
    jax.default_backend() != 'cpu' or not native.available(),
    reason=f'the native CPU map is not available: {native.unavailable_reason()}')


def test_native_map_is_built_where_a_compiler_is():
  if _COMPILER is None or os.environ.get('GEOPARAM_NATIVE') == '0':
    pytest.skip('no C++ compiler here, or GEOPARAM_NATIVE=0')
  assert native.available(), native.unavailable_reason()
  assert native.unavailable_reason() == ''
  if jax.default_backend() == 'cpu':
    assert hs._scheme(None, for_map=True) == 'native'


def _map_and_vjp(theta, g, scheme):
  u, vjp = jax.vjp(lambda t: hs.to_cartesian_batched(t, scheme), theta)
  return u, vjp(g)[0]


@needs_native
@pytest.mark.parametrize('shape', [(1, 3), (2, 1), (63, 64), (300, 7), (5, 2, 3), (4607, 5)])
def test_native_map_equals_the_sequential_scans(shape):
  rng = np.random.default_rng(shape[0])
  theta = jnp.asarray(rng.uniform(-4, 4, shape), jnp.float32)
  theta = theta.at[::3].set(0.0).at[1::5].set(np.pi)  # poles
  g = jnp.asarray(rng.normal(size=(shape[0] + 1,) + shape[1:]), jnp.float32)
  u, grad = jax.jit(_map_and_vjp, static_argnums=2)(theta, g, 'native')
  u_seq, grad_seq = jax.jit(_map_and_vjp, static_argnums=2)(theta, g, 'sequential')
  np.testing.assert_allclose(u, u_seq, rtol=0, atol=3e-7)
  np.testing.assert_allclose(grad, grad_seq, rtol=0, atol=2e-6 * float(jnp.max(jnp.abs(grad_seq))))
  np.testing.assert_allclose(np.linalg.norm(np.asarray(u, np.float64), axis=0), 1.0, atol=1e-6)
  # Against the float64 formula.
  ref = hs.to_cartesian_reference(np.asarray(theta, np.float64))
  np.testing.assert_allclose(u, ref, rtol=0, atol=1e-6)


@needs_native
def test_native_map_rows_beyond_the_polynomial_range_nan_and_signed_zero():
  theta = jnp.asarray([[0.5, 1e4 + 0.3, -3.0, 1e30], [0.0, 2.0, -0.0, 7.0]], jnp.float32).T
  u = hs.to_cartesian_batched(theta, 'native')
  np.testing.assert_allclose(u, hs.to_cartesian_reference(np.asarray(theta, np.float64)),
                             rtol=0, atol=2e-6)
  # sin(-0.0) = -0.0 carries into the products: u_2 = sin(t_1) cos(t_2) keeps the sign.
  u = hs.to_cartesian_batched(jnp.asarray([-0.0, 0.0], jnp.float32), 'native')
  assert np.signbit(u[1]) and np.signbit(u[2])
  u = hs.to_cartesian_batched(jnp.asarray([0.5, np.nan, 1.0], jnp.float32), 'native')
  assert np.isfinite(u[0]) and np.all(np.isnan(u[1:]))


@needs_native
def test_native_map_under_vmap_and_second_derivatives():
  rng = np.random.default_rng(0)
  theta = jnp.asarray(rng.uniform(-3, 3, (3, 12, 4)), jnp.float32)

  def loss(t, scheme):
    return jnp.sum(jax.vmap(lambda x: hs.to_cartesian_batched(x, scheme))(t) ** 3)

  for fn in (loss, jax.grad(loss)):
    np.testing.assert_allclose(fn(theta, 'native'), fn(theta, 'sequential'), rtol=0, atol=2e-6)

  def curvature(t, scheme):  # differentiates the forward and the VJP
    return jax.grad(lambda x: jnp.sum(jax.grad(loss)(x, scheme) ** 2))(t)

  got, want = curvature(theta[:1], 'native'), curvature(theta[:1], 'sequential')
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))
  # Forward over reverse (jax.hessian), rows beyond the polynomial's range included.
  t = theta[0, :6, :3].at[2, 1].set(1e4 + 0.3)

  def hessian(scheme):
    return jax.hessian(lambda x: jnp.sum(jnp.sin(hs.to_cartesian_batched(x, scheme))))(t)

  got, want = hessian('native'), hessian('sequential')
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))


@needs_native
def test_a_train_step_calls_the_native_kernels_and_no_scan():
  theta = jnp.ones((255, 64), jnp.float32)
  step = jax.jit(jax.grad(lambda t: jnp.sum(hs.to_cartesian_batched(t) ** 3)))
  hlo = step.lower(theta).compile().as_text()
  assert 'geoparam_map_forward' in hlo and 'geoparam_map_backward' in hlo
  assert ' while(' not in hlo


def _run(code, **env):
  """Runs `code` in a fresh interpreter with `env` added; returns its stdout."""
  proc = subprocess.run([sys.executable, '-c', textwrap.dedent(code)], capture_output=True,
                        text=True, timeout=300, env={**os.environ, 'JAX_PLATFORMS': 'cpu', **env})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


_FALLBACK = """
    import warnings
    import jax, jax.numpy as jnp, pytest
    from geoparam import hyperspherical as hs, native
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      print(native.available(),
            [str(w.message)[:60] for w in caught if str(w.message).startswith('geoparam')])
    print(native.unavailable_reason().splitlines()[0])
    theta = jnp.linspace(0.1, 3.0, 12).reshape(4, 3)
    print('while(' in jax.jit(hs.to_cartesian_batched).lower(theta).compile().as_text())
    with pytest.raises(ValueError, match="scheme='native' needs"):
      hs.to_cartesian_batched(theta, 'native')
    with pytest.raises(RuntimeError, match='geoparam.native is not available: '):
      native.forward(theta)
    print('raised')
"""


def test_switched_off_or_unbuildable_the_map_falls_back_to_the_scans(tmp_path):
  out = _run(_FALLBACK, GEOPARAM_NATIVE='0').splitlines()
  assert out == ['False []', 'GEOPARAM_NATIVE=0 is set', 'True', 'raised']
  if shutil.which('false') is None:
    pytest.skip('no `false` command here to stand for a failing compiler')
  # A compiler that fails: a warning that says so, then the scans; nothing left in the cache.
  out = _run(_FALLBACK, GEOPARAM_NATIVE='1', CXX='false', GEOPARAM_CACHE_DIR=str(tmp_path))
  out = out.splitlines()
  assert out[0].startswith("False ['geoparam.native:") and 'could not build' in out[0]
  assert out[1:] == [f'{shutil.which("false")} could not build native_map.cc:', 'True', 'raised']
  assert not list((tmp_path / 'native').iterdir())
  if _COMPILER is not None:  # a cache folder that cannot be made: the same fallback
    blocker = tmp_path / 'a_file'
    blocker.write_text('')
    out = _run(_FALLBACK, GEOPARAM_NATIVE='1', GEOPARAM_CACHE_DIR=str(blocker)).splitlines()
    assert out[0].startswith("False ['geoparam.native: building or loading it failed")
    assert out[2:] == ['True', 'raised']


def test_the_library_is_built_once_into_the_cache_folder(tmp_path):
  if _COMPILER is None:
    pytest.skip('no C++ compiler here')
  code = 'from geoparam import native; print(native.available(), native.unavailable_reason())'
  assert _run(code, GEOPARAM_NATIVE='1', GEOPARAM_CACHE_DIR=str(tmp_path)) == 'True \n'
  built = sorted((tmp_path / 'native').iterdir())
  assert len(built) == 1 and built[0].name.startswith('native_map-') and built[0].suffix == '.so'
  stamp = built[0].stat().st_mtime_ns
  assert _run(code, GEOPARAM_NATIVE='1', GEOPARAM_CACHE_DIR=str(tmp_path)) == 'True \n'
  assert built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt
