"""Shared fixtures for the geoparam test suite.

float64 is enabled per test (the `x64` fixture), never globally at import, so
the float32 tests see JAX's default dtypes.
"""

import jax
import numpy as np
import pytest


@pytest.fixture
def x64():
  """Runs the test with 64-bit types enabled."""
  with jax.enable_x64(True):
    yield


def ref_to_cartesian(theta):
  """Float64 numpy reference of eq. (10) for one neuron: explicit product loops.

  u_1 = cos t_1, u_k = sin t_1 ... sin t_{k-1} cos t_k, u_n = sin t_1 ... sin t_{n-1}.
  """
  theta = np.asarray(theta, np.float64)
  n = theta.shape[0] + 1
  u = np.empty(n, np.float64)
  for k in range(n):
    p = 1.0
    for j in range(k):
      p *= np.sin(theta[j])
    u[k] = p * (np.cos(theta[k]) if k < n - 1 else 1.0)
  return u


def ref_directions(theta):
  """Reference unit kernel `(n, m)` from angles `(n - 1, m)`, column by column."""
  theta = np.asarray(theta, np.float64)
  return np.stack([ref_to_cartesian(theta[:, j]) for j in range(theta.shape[1])], axis=1)


@pytest.fixture
def ref():
  """The numpy references, as a namespace usable from any test module."""

  class _Ref:
    to_cartesian = staticmethod(ref_to_cartesian)
    directions = staticmethod(ref_directions)

  return _Ref
