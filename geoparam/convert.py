"""Function-preserving conversion between standard (SP) and GmP parameters.

For a positively homogeneous activation (relu, leaky relu, identity) and
`scale > 0`::

  act(w^T x + b) = |w| act(u^T x + b / |w|),   u = w / |w|

so `scale = |w|`, `lam = b / |w|`, `theta = from_cartesian(w)`. A trained SP
checkpoint can therefore be turned into a GmP one (and back) and training can
go on with the same function.

These run eagerly on concrete arrays (checkpoints), not under `jit`: they check
their input (zero weight vectors, non-positive scales) and raise `ValueError`.

Pytree helpers walk nested dicts: every dict with a `kernel` entry (SP) or
with `theta`/`lam`/`scale` entries (GmP) is a layer. Paths are kept, so the SP
and GmP models should name their layers alike (`nn.Dense(..., name='hidden_0')`
and `GmPDense(..., name='hidden_0')`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from geoparam import gmp
from geoparam import hyperspherical

__all__ = ['dense_to_gmp', 'gmp_to_dense', 'sp_to_gmp', 'gmp_to_sp', 'HOMOGENEOUS']

# Activations with act(c z) = c act(z) for c > 0 (identity for any real c).
HOMOGENEOUS = ('relu', 'leaky_relu', 'linear')


def _check_activation(activation):
  if activation is None:
    activation = 'linear'
  if activation not in HOMOGENEOUS:
    raise ValueError(
        f'activation={activation!r} is not positively homogeneous, so SP <-> GmP conversion '
        f'would change the function; accepted: {HOMOGENEOUS} (or None for linear).')
  return activation


def dense_to_gmp(kernel, bias=None, activation: str | None = 'relu') -> dict[str, jax.Array]:
  """SP kernel and bias to GmP parameters.

  Args:
    kernel: `(fan_in, features)`, or a conv kernel `(*kernel_size, in, features)`
      (flattened to `(fan_in, features)` in `nn.Conv`'s order).
    bias: `(features,)` or None (zeros).
    activation: one of `HOMOGENEOUS` or None; anything else raises.

  Returns:
    `{'theta': (fan_in - 1, features), 'lam': (features,), 'scale': (features,)}`,
    plus `'sign': (features,)` when fan_in == 1. Dtype of `kernel`.
  """
  _check_activation(activation)
  kernel = jnp.asarray(kernel)
  if kernel.ndim < 2:
    raise ValueError(f'kernel must have shape (..., fan_in-part, features), got {kernel.shape}.')
  features = kernel.shape[-1]
  w = kernel.reshape(-1, features)
  norms = np.linalg.norm(np.asarray(w, np.float64), axis=0)
  if np.any(norms == 0) or not np.all(np.isfinite(norms)):
    bad = np.flatnonzero((norms == 0) | ~np.isfinite(norms))
    raise ValueError(
        f'kernel columns {bad.tolist()[:10]} are zero or not finite: a zero weight vector has '
        'no direction, so it has no GmP form.')
  bias = jnp.zeros((features,), w.dtype) if bias is None else jnp.asarray(bias, w.dtype)
  if bias.shape != (features,):
    raise ValueError(f'bias must have shape ({features},), got {bias.shape}.')
  if w.shape[0] == 1:
    scale = jnp.abs(w[0])
    return {'theta': jnp.zeros((0, features), w.dtype), 'lam': bias / scale, 'scale': scale,
            'sign': jnp.sign(w[0])}
  theta, scale = jax.vmap(hyperspherical.from_cartesian, in_axes=1, out_axes=(1, 0))(w)
  return {'theta': theta, 'lam': bias / scale, 'scale': scale}


def gmp_to_dense(params: Mapping[str, Any], kernel_shape=None,
                 activation: str | None = 'relu') -> tuple[jax.Array, jax.Array]:
  """GmP parameters to an SP `(kernel, bias)`: `kernel = scale * u(theta)`, `bias = scale * lam`.

  Args:
    params: a dict with `theta`, `lam`, `scale` (and `sign` for fan-in 1).
    kernel_shape: shape of the returned kernel (e.g. a conv kernel); default
      `(fan_in, features)`.
    activation: one of `HOMOGENEOUS` or None. For relu and leaky relu every
      `scale` must be > 0 (a negative scale flips the unit's output, which no SP
      unit can do); for linear any scale works.
  """
  activation = _check_activation(activation)
  missing = {'theta', 'lam', 'scale'} - set(params)
  if missing:
    raise ValueError(f'params lack GmP entries {sorted(missing)}; got keys {sorted(params)}.')
  scale = jnp.asarray(params['scale'])
  if activation != 'linear' and np.any(np.asarray(scale) <= 0):
    bad = np.flatnonzero(np.asarray(scale) <= 0)
    raise ValueError(
        f'units {bad.tolist()[:10]} have scale <= 0: with activation={activation!r} they have '
        'no SP equivalent (only scale > 0 is function preserving).')
  kernel = scale * gmp.gmp_kernel(jnp.asarray(params['theta']), params.get('sign'))
  bias = scale * jnp.asarray(params['lam'])
  if kernel_shape is not None:
    kernel_shape = tuple(kernel_shape)
    if int(np.prod(kernel_shape)) != kernel.size or kernel_shape[-1] != kernel.shape[-1]:
      raise ValueError(
          f'kernel_shape {kernel_shape} does not hold a ({kernel.shape[0]}, {kernel.shape[1]}) '
          'kernel.')
    kernel = kernel.reshape(kernel_shape)
  return kernel, bias


def _is_sp(node):
  return isinstance(node, Mapping) and 'kernel' in node and not isinstance(node['kernel'], Mapping)


def _is_gmp(node):
  return isinstance(node, Mapping) and {'theta', 'lam', 'scale'} <= set(node)


def _walk(tree, path, is_layer, convert):
  if is_layer(tree):
    return convert(path, tree)
  if isinstance(tree, Mapping):
    return {k: _walk(v, path + (k,), is_layer, convert) for k, v in tree.items()}
  return tree


def sp_to_gmp(params, select: Callable[[tuple[str, ...]], bool] = lambda path: True,
              activation: str | None = 'relu'):
  """Converts every selected SP layer (`{'kernel', 'bias'}` dict) of a param tree to GmP.

  Args:
    params: nested dict of parameters (e.g. `variables['params']`).
    select: called with each layer's path (tuple of names); layers for which
      it returns False are copied unchanged (e.g. the output layer, which the
      paper keeps plain).
    activation: the activation that follows the selected layers.
  """

  def convert(path, layer):
    if not select(path):
      return dict(layer)
    extra = set(layer) - {'kernel', 'bias'}
    if extra:
      raise ValueError(f'layer {"/".join(path)} has entries {sorted(extra)} besides kernel/bias.')
    return dense_to_gmp(layer['kernel'], layer.get('bias'), activation)

  return _walk(params, (), _is_sp, convert)


def gmp_to_sp(params, like=None, activation: str | None = 'relu'):
  """Converts every GmP layer of a param tree to SP `{'kernel', 'bias'}`.

  Args:
    params: nested dict of parameters.
    like: optional SP tree with the same paths (arrays or `jax.ShapeDtypeStruct`,
      e.g. `jax.eval_shape(sp_model.init, ...)['params']`) giving each kernel's
      shape (needed to get conv kernels back in their `(*kernel_size, in, out)` form).
    activation: the activation that follows the GmP layers.
  """

  def convert(path, layer):
    shape = None
    if like is not None:
      node = like
      for key in path:
        if not isinstance(node, Mapping) or key not in node:
          raise ValueError(f'`like` has no layer at {"/".join(path)}.')
        node = node[key]
      shape = tuple(node['kernel'].shape)
    kernel, bias = gmp_to_dense(layer, shape, activation)
    return {'kernel': kernel, 'bias': bias}

  return _walk(params, (), _is_gmp, convert)
