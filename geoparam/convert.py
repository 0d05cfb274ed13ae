"""Function-preserving conversion between standard (SP) and GmP parameters.

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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from geoparam import gmp

__all__ = ['dense_to_gmp', 'gmp_to_dense', 'sp_to_gmp', 'gmp_to_sp', 'HOMOGENEOUS']

# Activations with act(c z) = c act(z) for c > 0 (identity for any real c).
HOMOGENEOUS = ('relu', 'leaky_relu', 'linear')


# The activation functions conversion accepts, by identity, and their names in HOMOGENEOUS.
# flax.linen's relu and leaky_relu are jax.nn's functions; both are listed in case they differ.
_FUNCTIONS = (
    (jax.nn.relu, 'relu'), (nn.relu, 'relu'),
    (jax.nn.leaky_relu, 'leaky_relu'), (nn.leaky_relu, 'leaky_relu'),
    (jax.nn.identity, 'linear'),
)
_ACCEPTED = (
    f'a name in {HOMOGENEOUS}, None (linear), or the function jax.nn.relu / flax.linen.relu, '
    'jax.nn.leaky_relu / flax.linen.leaky_relu (or functools.partial of it with '
    'negative_slope=...), jax.nn.identity')


def _check_activation(activation) -> str:
  """The name in `HOMOGENEOUS` of `activation` (a name, None or a known function), or raises."""
  if activation is None:
    return 'linear'
  if isinstance(activation, str):
    if activation in HOMOGENEOUS:
      return activation
  elif callable(activation):
    fn = activation
    if (isinstance(fn, functools.partial) and not fn.args
        and set(fn.keywords) <= {'negative_slope'}):
      fn = fn.func
      leaky = [f for f, name in _FUNCTIONS if name == 'leaky_relu']
      if not any(fn is f for f in leaky):
        fn = activation  # only leaky relu's slope may be bound
    for f, name in _FUNCTIONS:
      if fn is f:
        return name
  raise ValueError(
      f'activation={activation!r} is not a positively homogeneous activation that conversion '
      f'knows, so SP <-> GmP conversion could change the function; accepted: {_ACCEPTED}.')


def _columns(mask, limit=10) -> str:
  """Indices where `mask` holds, at most `limit` of them, as text."""
  bad = np.flatnonzero(mask).tolist()
  more = f' (and {len(bad) - limit} more)' if len(bad) > limit else ''
  return f'{bad[:limit]}{more}'


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
  kernel = jnp.asarray(kernel)
  if kernel.ndim < 2:
    raise ValueError(f'kernel must have shape (..., fan_in-part, features), got {kernel.shape}.')
  if jnp.issubdtype(kernel.dtype, jnp.complexfloating):
    raise ValueError(f'kernel must be real, got dtype {kernel.dtype}.')
  if not jnp.issubdtype(kernel.dtype, jnp.floating):
    kernel = kernel.astype(jnp.result_type(float))  # so that a float bias is not truncated
  features = kernel.shape[-1]
  w = kernel.reshape(-1, features)
  dtype = w.dtype
  finfo = jnp.finfo(dtype)
  norms = np.linalg.norm(np.asarray(w, np.float64), axis=0)
  if np.any(norms == 0) or not np.all(np.isfinite(norms)):
    raise ValueError(
        f'kernel columns {_columns((norms == 0) | ~np.isfinite(norms))} are zero or not finite: '
        'a zero weight vector has no direction, so it has no GmP form.')
  tiny = norms < float(finfo.tiny)
  if np.any(tiny):
    raise ValueError(
        f'kernel columns {_columns(tiny)} have norm |w| (e.g. {norms[tiny][0]:.3g}) below the '
        f'smallest normal {dtype} number (np.finfo({dtype}).tiny = {float(finfo.tiny):.4g}): '
        f'scale = |w| underflows in {dtype} (XLA flushes subnormals to 0) and lam = b / |w| is '
        'not finite. Rescale those units or convert in float64.')
  huge = norms > float(finfo.max)
  if np.any(huge):
    raise ValueError(
        f'kernel columns {_columns(huge)} have norm |w| (e.g. {norms[huge][0]:.3g}) above the '
        f'largest {dtype} number ({float(finfo.max):.4g}): scale = |w| overflows in {dtype}.')
  with np.errstate(over='ignore', invalid='ignore'):  # an overflowing cast is reported below
    bias = jnp.zeros((features,), dtype) if bias is None else jnp.asarray(bias, dtype)
  if bias.shape != (features,):
    raise ValueError(f'bias must have shape ({features},), got {bias.shape}.')
  bias_np = np.asarray(bias)
  if not np.all(np.isfinite(bias_np)):
    raise ValueError(
        f'bias entries {_columns(~np.isfinite(bias_np))} are not finite in {dtype} (inf or NaN, '
        f'or beyond np.finfo({dtype}).max = {float(finfo.max):.4g} once cast to it).')
  out = gmp.gmp_from_dense(w, bias)
  # Checked in the returned dtype: what the GmP model will compute with.
  scale_np, lam_np = np.asarray(out['scale']), np.asarray(out['lam'])
  bad_scale = ~(np.isfinite(scale_np) & (scale_np > 0))
  if np.any(bad_scale):
    raise ValueError(
        f'kernel columns {_columns(bad_scale)}: scale = |w| is {scale_np[bad_scale][:3].tolist()} '
        f'in {dtype}, not a finite number > 0 (|w| near np.finfo({dtype}).tiny = '
        f'{float(finfo.tiny):.4g} or max = {float(finfo.max):.4g}).')
  bad_lam = ~np.isfinite(lam_np)
  if np.any(bad_lam):
    raise ValueError(
        f'columns {_columns(bad_lam)}: lam = b / |w| overflows {dtype} (b = '
        f'{[f"{x:.3g}" for x in bias_np[bad_lam][:3]]}, |w| = '
        f'{[f"{x:.3g}" for x in norms[bad_lam][:3]]}; '
        f'np.finfo({dtype}).max = {float(finfo.max):.4g}). Rescale those units or convert in '
        'float64.')
  if not np.all(np.isfinite(np.asarray(out['theta']))):
    raise ValueError(
        f'kernel columns {_columns(~np.all(np.isfinite(np.asarray(out["theta"])), axis=0))}: '
        'the angles are not finite.')
  return out


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
  if not isinstance(params, Mapping):
    raise TypeError(
        f"params must be a dict of one GmP layer's entries (theta, lam, scale), got "
        f'{type(params).__name__}.')
  missing = {'theta', 'lam', 'scale'} - set(params)
  if missing:
    raise ValueError(f'params lack GmP entries {sorted(missing)}; got keys {sorted(params)}.')
  theta = jnp.asarray(params['theta'])
  if theta.ndim != 2:
    raise ValueError(f'theta must have shape (fan_in - 1, features), got {theta.shape}.')
  features = theta.shape[1]
  entries = {k: np.asarray(params[k]) for k in ('lam', 'scale', 'sign')
             if params.get(k) is not None}
  for name, value in entries.items():
    if value.shape != (features,):
      raise ValueError(
          f'{name} must have shape ({features},) to match theta of shape {theta.shape} (one '
          f'entry per feature), got shape {value.shape}.')
  for name, value in [('theta', np.asarray(theta))] + list(entries.items()):
    if not np.all(np.isfinite(value)):
      raise ValueError(
          f'{name} has entries that are not finite (units '
          f'{_columns(~np.isfinite(value).reshape(-1, features).all(axis=0))}).')
  scale = jnp.asarray(params['scale'])
  if activation != 'linear' and np.any(np.asarray(scale) <= 0):
    bad = np.flatnonzero(np.asarray(scale) <= 0)
    raise ValueError(
        f'units {bad.tolist()[:10]} have scale <= 0: with activation={activation!r} they have '
        'no SP equivalent (only scale > 0 is function preserving).')
  kernel = scale * gmp.gmp_kernel(theta, params.get('sign'))
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


def _holds_layer(tree, is_layer) -> bool:
  if is_layer(tree):
    return True
  if isinstance(tree, Mapping):
    return any(_holds_layer(v, is_layer) for v in tree.values())
  if isinstance(tree, (list, tuple)):
    return any(_holds_layer(v, is_layer) for v in tree)
  return False


def _name(path) -> str:
  return '/'.join(str(k) for k in path)


def _walk(tree, path, is_layer, convert):
  if is_layer(tree):
    try:
      return convert(path, tree)
    except ValueError as e:
      if not path:
        raise
      raise ValueError(f'layer {_name(path)}: {e}') from e
  if isinstance(tree, Mapping):
    return {k: _walk(v, path + (k,), is_layer, convert) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)) and _holds_layer(tree, is_layer):
    raise TypeError(
        f'params must be a nested dict (Mapping) of layers; got a {type(tree).__name__} holding '
        f'layers at {_name(path) or "the top level"}. Only dicts are walked: convert the '
        'elements one by one, or key the layers by name in a dict.')
  return tree


def _check_tree(params):
  if not isinstance(params, Mapping):
    raise TypeError(
        'params must be a nested dict (Mapping) of layers (e.g. variables["params"]), got '
        f'{type(params).__name__}.')


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
  if not callable(select):
    raise TypeError(
        f'select must be a callable taking a layer path tuple (e.g. lambda path: path[0] != '
        f"'out') and returning a bool, got {select!r} of type {type(select).__name__}.")
  _check_activation(activation)
  _check_tree(params)

  def convert(path, layer):
    if not select(path):
      return dict(layer)
    extra = set(layer) - {'kernel', 'bias'}
    if extra:
      raise ValueError(
          f'unexpected entries {sorted(extra)} besides kernel/bias: not a plain Dense/Conv layer.')
    return dense_to_gmp(layer['kernel'], layer.get('bias'), activation)

  return _walk(params, (), _is_sp, convert)


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
  _check_tree(params)
  if like is not None and not isinstance(like, Mapping):
    raise TypeError(f'like must be a nested dict (Mapping) or None, got {type(like).__name__}.')

  def convert(path, layer):
    extra = set(layer) - {'theta', 'lam', 'scale', 'sign'}
    if extra:
      raise ValueError(
          f'unexpected entries {sorted(extra)} besides theta/lam/scale/sign: not a GmP layer.')
    shape = None
    if like is not None:
      node = like
      for key in path:
        if not isinstance(node, Mapping) or key not in node:
          raise ValueError(f'`like` has no layer at {_name(path)}.')
        node = node[key]
      if not _is_sp(node):
        raise ValueError(f'`like` has no SP kernel at {_name(path)} (got {node!r:.80}).')
      shape = tuple(node['kernel'].shape)
    kernel, bias = gmp_to_dense(layer, shape, activation)
    return {'kernel': kernel, 'bias': bias}

  return _walk(params, (), _is_gmp, convert)
