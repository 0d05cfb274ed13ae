"""Tests for geoparam.lcw: the zero-sum reparameterization w = B_m v."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from geoparam import lcw


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


@pytest.mark.parametrize('m', [2, 3, 100, 4608])
def test_project_zero_sum_and_isometry(x64, m):
  rng = np.random.default_rng(m)
  v = rng.normal(size=(m - 1,)) + 3.0  # a large mean makes a wrong zero-sum visible
  w = np.asarray(lcw.project(jnp.asarray(v)))
  assert w.shape == (m,)
  assert w.dtype == np.float64
  assert abs(w.sum()) < 1e-12 * np.linalg.norm(v) * np.sqrt(m)
  np.testing.assert_allclose(np.linalg.norm(w), np.linalg.norm(v), rtol=1e-13)


@pytest.mark.parametrize('m', [2, 3, 100, 4608])
def test_project_float32(m):
  v = jax.random.normal(jax.random.key(m), (m - 1,)) + 3.0
  w = lcw.project(v)
  assert w.dtype == jnp.float32
  scale = float(jnp.linalg.norm(v)) * np.sqrt(m)
  assert abs(float(jnp.sum(w))) < 1e-6 * scale
  np.testing.assert_allclose(jnp.linalg.norm(w), jnp.linalg.norm(v), rtol=1e-5)


@pytest.mark.parametrize('m', [2, 3, 17, 100])
def test_basis_orthonormal_and_matches_project(x64, m):
  b = np.asarray(lcw.basis(m, dtype=jnp.float64))
  assert b.shape == (m, m - 1)
  np.testing.assert_allclose(b.T @ b, np.eye(m - 1), atol=1e-13)
  np.testing.assert_allclose(b.T @ np.ones(m), 0.0, atol=1e-13)
  # Columns span the whole zero-sum subspace: B B^T is its projector I - 11^T / m.
  np.testing.assert_allclose(b @ b.T, np.eye(m) - np.ones((m, m)) / m, atol=1e-13)
  v = np.random.default_rng(0).normal(size=(m - 1, 5))
  w = jax.vmap(lcw.project, in_axes=1, out_axes=1)(jnp.asarray(v))
  np.testing.assert_allclose(w, b @ v, atol=1e-13)


def test_basis_m2_is_the_normalized_difference(x64):
  b = np.asarray(lcw.basis(2, dtype=jnp.float64))
  np.testing.assert_allclose(np.abs(b[:, 0]), [2**-0.5, 2**-0.5], rtol=1e-14)
  assert b[0, 0] * b[1, 0] < 0


@pytest.mark.parametrize('m', [2, 5, 64])
def test_coordinates_is_transpose(x64, m):
  rng = np.random.default_rng(1)
  b = np.asarray(lcw.basis(m, dtype=jnp.float64))
  w = rng.normal(size=(m,)) + 1.0
  v = np.asarray(lcw.coordinates(jnp.asarray(w)))
  np.testing.assert_allclose(v, b.T @ w, atol=1e-13)
  np.testing.assert_allclose(lcw.project(jnp.asarray(v)), w - w.mean(), atol=1e-13)
  v2 = rng.normal(size=(m - 1,))
  np.testing.assert_allclose(lcw.coordinates(lcw.project(jnp.asarray(v2))), v2, atol=1e-13)


@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(2, 40),
    a=st.floats(-3, 3),
    b=st.floats(-3, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_project_is_linear(m, a, b, seed):
  with jax.enable_x64(True):
    rng = np.random.default_rng(seed)
    v1, v2 = rng.normal(size=(2, m - 1))
    lhs = lcw.project(jnp.asarray(a * v1 + b * v2))
    rhs = a * lcw.project(jnp.asarray(v1)) + b * lcw.project(jnp.asarray(v2))
    np.testing.assert_allclose(lhs, rhs, atol=1e-12)


def test_grad_matches_basis_transpose(x64):
  m = 9
  rng = np.random.default_rng(2)
  g = rng.normal(size=(m,))
  v = rng.normal(size=(m - 1,))
  grad = jax.grad(lambda v: jnp.dot(jnp.asarray(g), lcw.project(v)))(jnp.asarray(v))
  np.testing.assert_allclose(grad, np.asarray(lcw.basis(m, jnp.float64)).T @ g, atol=1e-13)


def test_jit_and_int_input():
  w = jax.jit(lcw.project)(jnp.arange(4))
  assert jnp.issubdtype(w.dtype, jnp.floating)
  assert abs(float(w.sum())) < 1e-5


def test_bfloat16_dtype_kept():
  w = lcw.project(jnp.ones((7,), jnp.bfloat16))
  assert w.dtype == jnp.bfloat16


@pytest.mark.parametrize('bad', [jnp.zeros((0,)), jnp.zeros((2, 3)), jnp.float32(1.0)])
def test_project_bad_shape(bad):
  with pytest.raises(ValueError, match='m >= 2'):
    lcw.project(bad)


@pytest.mark.parametrize('m', [1, 0, -3, 2.5, True])
def test_basis_bad_m(m):
  with pytest.raises(ValueError, match=r'basis: m must be an int(eger in \[2,| >= 2)'):
    lcw.basis(m)


def test_coordinates_bad_shape():
  with pytest.raises(ValueError, match='m >= 2'):
    lcw.coordinates(jnp.zeros((1,)))


@pytest.mark.parametrize('m', [2, 3, 17, 1024])
def test_project_batched_equals_explicit_basis_and_vmapped_project(m):
  with jax.enable_x64(True):
    v = np.random.default_rng(m).normal(size=(m - 1, 5, 2))
    w = np.asarray(lcw.project_batched(jnp.asarray(v)))
    np.testing.assert_allclose(w, np.einsum('ij,jkl->ikl', np.asarray(lcw.basis(m, jnp.float64)), v),
                               atol=1e-12)
    vmapped = jax.vmap(jax.vmap(lcw.project, in_axes=1, out_axes=1), in_axes=2, out_axes=2)
    np.testing.assert_allclose(w, vmapped(jnp.asarray(v)), atol=1e-13)
    np.testing.assert_allclose(w.sum(axis=0), 0.0, atol=1e-12)


def test_project_batched_bad_shape():
  with pytest.raises(ValueError, match='m >= 2'):
    lcw.project_batched(jnp.zeros((0, 3)))


@pytest.mark.parametrize('dtype', [jnp.int32, jnp.bool_, 'int8'])
def test_basis_integer_dtype_is_a_type_error(dtype):
  # Cast to an integer dtype, the irrational entries would silently truncate.
  with pytest.raises(TypeError, match='floating'):
    lcw.basis(4, dtype=dtype)


def test_project_non_numeric_is_a_type_error():
  with pytest.raises(TypeError, match='key'):
    lcw.project_batched(jax.random.split(jax.random.key(0), 3))


def test_project_complex_is_the_same_linear_map(x64):
  # Complex coordinates are kept: B_m is real, so w = B_m v is well defined, zero-sum, |w| = |v|.
  rng = np.random.default_rng(3)
  v = rng.normal(size=(6, 2)) + 1j * rng.normal(size=(6, 2))
  w = np.asarray(lcw.project_batched(jnp.asarray(v)))
  assert w.dtype == np.complex128
  np.testing.assert_allclose(w, np.asarray(lcw.basis(7, jnp.float64)) @ v, atol=1e-13)
  np.testing.assert_allclose(w.sum(axis=0), 0.0, atol=1e-13)
  np.testing.assert_allclose(lcw.coordinates(jnp.asarray(w[:, 0])), v[:, 0], atol=1e-13)


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float16])
def test_narrow_float_project_rounds_once(dtype):
  # Computed in float32 and rounded once per entry (bf16 arithmetic rounds the sum too).
  v = (jax.random.normal(jax.random.key(1), (4607, 3)) + 3.0).astype(dtype)
  w = lcw.project_batched(v)
  assert w.dtype == dtype
  np.testing.assert_array_equal(w, lcw.project_batched(v.astype(jnp.float32)).astype(dtype))
  c = lcw.coordinates(w[:, 0])
  assert c.dtype == dtype
  np.testing.assert_array_equal(c, lcw.coordinates(w[:, 0].astype(jnp.float32)).astype(dtype))
