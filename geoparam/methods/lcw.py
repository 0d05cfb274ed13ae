"""LCW, linearly constrained weights (paper 003 Sec. 3): `kernel = B_m v`, every unit sums to zero.

Stored: `v (fan_in - 1, F)` and the layer's `bias`. `v` starts as the
coordinates `B_m^T w` of the layer's own `kernel_init` draw (its zero-sum part).
`B_m` is never formed (`geoparam.lcw.project_batched`, O(m) per unit). A kernel
whose units do not sum to zero has no LCW form: `convert` raises.

    >>> import numpy as np
    >>> from geoparam import methods
    >>> lcw = methods.get('lcw')
    >>> params = lcw.convert(np.array([[1.0], [-1.0]]), np.zeros(1), np.float32, True)
    >>> params['v'].shape, [a.round(5).tolist() for a in lcw.bake(params, (2, 1))]
    ((1, 1), [[[1.0], [-1.0]], [0.0]])
"""

from __future__ import annotations

from flax.core import meta
import jax
import jax.numpy as jnp
import numpy as np

from geoparam import lcw as lcw_map
from geoparam.methods import base

__all__ = ['lcw', 'kernel_from_v', 'v_from_kernel']


def kernel_from_v(v: jax.Array, kernel_shape: tuple[int, ...] | None = None) -> jax.Array:
  """Zero-sum kernel `B v` from LCW coordinates `v (fan_in - 1, features)`.

  Returns `(fan_in, features)`, or `kernel_shape` (`(*spatial, in, features)`,
  whose product over all axes but the last is `fan_in`); each column sums to zero
  and has the norm of the matching column of `v`.
  """
  kernel = lcw_map.project_batched(v)
  return kernel if kernel_shape is None else kernel.reshape(kernel_shape)


def v_from_kernel(kernel: jax.Array) -> jax.Array:
  """LCW coordinates `v = B^T w (fan_in - 1, features)` of a kernel `(..., features)`.

  `kernel_from_v(v)` is the kernel minus its per-unit mean (the kernel itself when
  every unit already sums to zero).
  """
  features = kernel.shape[-1]
  return jax.vmap(lcw_map.coordinates, in_axes=1, out_axes=1)(kernel.reshape(-1, features))


def _apply(params, kernel_shape):
  return kernel_from_v(params['v'], kernel_shape), params.get('bias')


def _convert(kernel, bias, dtype, use_bias):
  w = kernel.reshape(-1, kernel.shape[-1])
  base.check_zero_sum('LCW', w)
  return base.with_layer_bias({'v': jnp.asarray(v_from_kernel(jnp.asarray(w)), dtype)}, bias,
                              dtype, use_bias)


def _bake(params, kernel_shape):
  v = np.asarray(meta.unbox(params['v']), np.float64)
  kernel = np.asarray(kernel_from_v(jnp.asarray(v), kernel_shape))
  bias = params.get('bias')
  return kernel, None if bias is None else np.asarray(meta.unbox(bias), np.float64)


def _from_kernel(kernel, bias, use_bias):
  return {'v': v_from_kernel(kernel), **({'bias': bias} if use_bias else {})}


def lcw() -> base.Method:
  """LCW as a `Method`."""

  def params(kernel_shape, layer, new_key):
    del new_key

    def v_init(key, shape, dtype=jnp.float32):  # the zero-sum part of the layer's own draw
      del shape
      return v_from_kernel(meta.unbox(layer.kernel_init(key, kernel_shape, dtype)))

    out = {'v': base.Param((base.fan_in(kernel_shape) - 1, kernel_shape[-1]), v_init)}
    if layer.use_bias:
      out['bias'] = base.Param((kernel_shape[-1],), layer.bias_init, role='bias')
    return out

  return base.Method('lcw', params, _apply, _convert, _bake, min_fan_in=2,
                     fan_in_reason='one weight has no nonzero zero-sum value',
                     from_kernel=_from_kernel, linear_in='v')
