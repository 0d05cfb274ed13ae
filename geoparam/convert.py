"""Function-preserving conversion between standard (SP) and GmP parameters of param trees.

The conversion of one layer is the `gmp` method's (`geoparam.methods.gmp.from_dense`
and `to_dense`); this module adds the activation check and the pytree walk.

For a positively homogeneous activation (relu, leaky relu, identity) and
`scale > 0`::

  act(w^T x + b) = |w| act(u^T x + b / |w|),   u = w / |w|

so `scale = |w|`, `lam = b / |w|`, `theta = from_cartesian(w)`. A trained SP
checkpoint can therefore be turned into a GmP one (and back) and training can
go on with the same function.

These run eagerly on concrete arrays (checkpoints), not under `jit`: they check
their input and raise `ValueError` where the result would not be a finite,
function-preserving GmP (or SP) layer: zero, non-finite or too small weight
vectors (a norm below `np.finfo(dtype).tiny` underflows the scale), biases
whose `b / |w|` overflows, non-positive or non-finite scales, shapes that
do not match.

`activation` is a name in `HOMOGENEOUS`, None (linear) or one of the functions
`jax.nn.relu`, `jax.nn.leaky_relu` (also `functools.partial(jax.nn.leaky_relu,
negative_slope=s)`), `jax.nn.identity` (flax.linen's relu and leaky_relu are
the same functions), so the callable given to `GmPDense(activation=...)` can be
passed as is.

Pytree helpers walk nested dicts (Mappings) only: every dict with a `kernel`
entry (SP) or with `theta`/`lam`/`scale` entries (GmP) is a layer; a list or
tuple holding layers raises `TypeError`. Paths are kept, so the SP and GmP
models should name their layers alike (`nn.Dense(..., name='hidden_0')` and
`GmPDense(..., name='hidden_0')`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import functools
from typing import Any

import jax
import numpy as np

from geoparam import checks
from geoparam.methods import gmp as gmp_method
from geoparam.selection import name as _name

__all__ = ['dense_to_gmp', 'gmp_to_dense', 'sp_to_gmp', 'gmp_to_sp', 'HOMOGENEOUS']

# Activations with act(c z) = c act(z) for c > 0 (identity for any real c).
HOMOGENEOUS = ('relu', 'leaky_relu', 'linear')


# The activation functions conversion accepts, by identity, and their names in HOMOGENEOUS
# (flax.linen's relu and leaky_relu are these functions).
_FUNCTIONS = ((jax.nn.relu, 'relu'), (jax.nn.leaky_relu, 'leaky_relu'), (jax.nn.identity, 'linear'))
_ACCEPTED = (
    f'a name in {HOMOGENEOUS}, None (linear), or the function jax.nn.relu / flax.linen.relu, '
    'jax.nn.leaky_relu / flax.linen.leaky_relu (or functools.partial of it with '
    'negative_slope=...), jax.nn.identity')


def _check_activation(activation) -> str:
  """The name in `HOMOGENEOUS` of `activation` (a name, None or a known function), or raises."""
  if activation is None:
    return 'linear'
  if isinstance(activation, str) and activation in HOMOGENEOUS:
    return activation
  fn = activation
  if (isinstance(fn, functools.partial) and fn.func is jax.nn.leaky_relu and not fn.args
      and set(fn.keywords) <= {'negative_slope'}):
    fn = fn.func  # only leaky relu's slope may be bound
  for f, name in _FUNCTIONS:
    if fn is f:
      return name
  raise ValueError(
      f'activation={activation!r} is not a positively homogeneous activation that conversion '
      f'knows, so SP <-> GmP conversion could change the function; accepted: {_ACCEPTED}.')


def dense_to_gmp(kernel, bias=None, activation: str | None = 'relu') -> dict[str, jax.Array]:
  """SP kernel and bias to GmP parameters.

  Args:
    kernel: `(fan_in, features)`, or a conv kernel `(*kernel_size, in, features)`
      (flattened to `(fan_in, features)` in `nn.Conv`'s order).
    bias: `(features,)` or None (zeros).
    activation: see the module docstring (a name in `HOMOGENEOUS`, None, or
      relu / leaky relu / identity as a function); anything else raises.

  Returns:
    `{'theta': (fan_in - 1, features), 'lam': (features,), 'scale': (features,)}`,
    plus `'sign': (features,)` when fan_in == 1. Dtype of `kernel` (the default
    float dtype for an integer or bool kernel). Every `scale` is > 0 and every
    entry finite in that dtype, or this raises `ValueError`.

  Example usage::

    >>> import flax.linen as nn, numpy as np
    >>> from geoparam import convert
    >>> params = convert.dense_to_gmp(np.ones((3, 2), np.float32), activation=nn.relu)
    >>> {k: v.shape for k, v in params.items()}
    {'theta': (2, 2), 'lam': (2,), 'scale': (2,)}
    >>> convert.dense_to_gmp(np.full((3, 2), 1e-39, np.float32))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
      ...
    ValueError: kernel columns [0, 1] have norm |w| (e.g. 1.73e-39) below the smallest normal ...
  """
  _check_activation(activation)
  return gmp_method.from_dense(kernel, bias)


def gmp_to_dense(params: Mapping[str, Any], kernel_shape=None,
                 activation: str | None = 'relu') -> tuple[jax.Array, jax.Array]:
  """GmP parameters to an SP `(kernel, bias)`: `kernel = scale * u(theta)`, `bias = scale * lam`.

  Args:
    params: a dict with `theta`, `lam`, `scale` (and `sign` for fan-in 1).
    kernel_shape: shape of the returned kernel (e.g. a conv kernel); default
      `(fan_in, features)`.
    activation: as for `dense_to_gmp`. For relu and leaky relu every
      `scale` must be > 0 (a negative scale flips the unit's output, which no SP
      unit can do); for linear any finite scale works.
  """
  activation = _check_activation(activation)
  kernel, bias = gmp_method.to_dense(params, kernel_shape)
  scale = np.asarray(params['scale'])
  if activation != 'linear' and np.any(scale <= 0):
    raise ValueError(
        f'units {np.flatnonzero(scale <= 0).tolist()[:10]} have scale <= 0: with '
        f'activation={activation!r} they have no SP equivalent (only scale > 0 is function '
        'preserving).')
  return kernel, bias


def _is_sp(node):
  return isinstance(node, Mapping) and 'kernel' in node and not isinstance(node['kernel'], Mapping)


def _is_gmp(node):
  return isinstance(node, Mapping) and {'theta', 'lam', 'scale'} <= set(node)


def _walk(tree, path, is_layer, convert):
  if not path and not isinstance(tree, Mapping):
    raise TypeError(
        'params must be a nested dict (Mapping) of layers (e.g. variables["params"]), got '
        f'{type(tree).__name__}.')
  if is_layer(tree):
    try:
      return convert(path, tree)
    except ValueError as e:
      if not path:
        raise
      raise ValueError(f'layer {_name(path)}: {e}') from e
  if isinstance(tree, Mapping):
    return {k: _walk(v, path + (k,), is_layer, convert) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)) and any(
      map(is_layer, jax.tree.leaves(tree, is_leaf=is_layer))):
    raise TypeError(
        f'params must be a nested dict (Mapping) of layers; got a {type(tree).__name__} holding '
        f'layers at {_name(path)}. Only dicts are walked: convert the '
        'elements one by one, or key the layers by name in a dict.')
  return tree


def sp_to_gmp(params, select: Callable[[tuple[str, ...]], bool] = lambda path: True,
              activation: str | None = 'relu'):
  """Converts every selected SP layer (`{'kernel', 'bias'}` dict) of a param tree to GmP.

  Args:
    params: nested dict (Mapping) of parameters (e.g. `variables['params']`);
      lists and tuples of layers raise `TypeError`.
    select: a callable taking a layer's path (tuple of names) and returning a
      bool; layers for which it returns False are copied unchanged (e.g. the
      output layer, which the paper keeps plain).
    activation: the activation that follows the selected layers (see
      `dense_to_gmp`).
  """
  checks.function('select', select, "a callable taking a layer path tuple (e.g. lambda path: "
                  "path[0] != 'out') and returning a bool")
  _check_activation(activation)
  found, converted = [], []

  def convert(path, layer):
    found.append(path)
    if not select(path):
      return dict(layer)
    converted.append(path)
    extra = set(layer) - {'kernel', 'bias'}
    if extra:
      raise ValueError(
          f'unexpected entries {sorted(extra)} besides kernel/bias: not a plain Dense/Conv layer.')
    return gmp_method.from_dense(layer['kernel'], layer.get('bias'))  # activation: checked

  out = _walk(params, (), _is_sp, convert)
  if not converted:
    raise ValueError(f'sp_to_gmp: no layer was converted ({len(found)} SP layers found '
                     f'{[_name(p) for p in found][:10]}, select={select!r}): a tree without '
                     'a selected {kernel, bias} layer would come back unchanged.')
  return out


def gmp_to_sp(params, like=None, activation: str | None = 'relu'):
  """Converts every GmP layer of a param tree to SP `{'kernel', 'bias'}`.

  Args:
    params: nested dict of parameters.
    like: optional SP tree with the same paths (arrays or `jax.ShapeDtypeStruct`,
      e.g. `jax.eval_shape(sp_model.init, ...)['params']`) giving each kernel's
      shape (needed to get conv kernels back in their `(*kernel_size, in, out)` form).
    activation: the activation that follows the GmP layers (see `dense_to_gmp`).
  """
  _check_activation(activation)
  if like is not None and not isinstance(like, Mapping):
    raise TypeError(f'like must be a nested dict (Mapping) or None, got {type(like).__name__}.')

  found = []

  def convert(path, layer):
    found.append(path)
    extra = set(layer) - {'theta', 'lam', 'scale', 'sign'}
    if extra:
      raise ValueError(
          f'unexpected entries {sorted(extra)} besides theta/lam/scale/sign: not a GmP layer.')
    shape = None
    if like is not None:
      node = like
      for key in path:
        node = node.get(key) if isinstance(node, Mapping) else None
      if not _is_sp(node):
        raise ValueError(f'`like` has no SP kernel at {_name(path)} (got {node!r:.80}).')
      shape = tuple(node['kernel'].shape)
    kernel, bias = gmp_to_dense(layer, shape, activation)
    return {'kernel': kernel, 'bias': bias}

  out = _walk(params, (), _is_gmp, convert)
  if not found:
    raise ValueError('gmp_to_sp: the tree holds no GmP layer (a dict with theta, lam, scale): it '
                     'would come back unchanged.')
  return out
