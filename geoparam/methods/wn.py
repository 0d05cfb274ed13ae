"""WN, weight normalization (Salimans & Kingma 2016): `kernel = scale * k / |k|` per unit.

Stored: `kernel` (the layer's shape and `kernel_init`), `scale (F,)`, the
layer's `bias`. The formula is `nn.WeightNorm`'s; the gain sits beside the
kernel, so conversion is exact: `scale = sqrt(|w|^2 + epsilon)`.

    >>> import numpy as np
    >>> from geoparam import methods
    >>> wn = methods.get('wn', epsilon=0.0)
    >>> params = wn.convert(np.array([[3.0], [4.0]]), np.zeros(1), np.float32, True)
    >>> params['scale'].tolist(), wn.bake(params, (2, 1))[0].tolist()
    ([5.0], [[3.0], [4.0]])
"""

from __future__ import annotations

from collections.abc import Callable

from jax.nn import initializers as jinit
from flax.core import meta
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from geoparam import checks
from geoparam.methods import base

__all__ = ['wn', 'weight_norm', 'normed']


def weight_norm(kernel: jax.Array, scale: jax.Array, epsilon: float = 1e-12) -> jax.Array:
  """`scale * k / |k|` per unit (all axes but the last), as `nn.WeightNorm`'s formula."""
  axes = tuple(range(kernel.ndim - 1))
  inv_norm = lax.rsqrt(jnp.sum(kernel * kernel, axis=axes, keepdims=True) + epsilon)
  return kernel * inv_norm * scale


def normed(name: str, formula: Callable, scale_init, epsilon: float, min_fan_in: int = 1,
           fan_in_reason: str = '', zero_sum: bool = False) -> base.Method:
  """A method storing `kernel`, `scale (F,)`, `bias`, seen as `formula(kernel, scale, epsilon)`.

  `zero_sum`: only kernels whose units sum to zero convert (the formula centres them).
  """
  checks.real('epsilon', epsilon, '>= 0', lambda x: x >= 0)

  def params(kernel_shape, layer, new_key):
    del new_key
    out = {'kernel': base.Param(tuple(kernel_shape), layer.kernel_init),
           'scale': base.Param((kernel_shape[-1],), scale_init, role='scale')}
    if layer.use_bias:
      out['bias'] = base.Param((kernel_shape[-1],), layer.bias_init, role='bias')
    return out

  def apply(params, kernel_shape):
    del kernel_shape
    return formula(params['kernel'], params['scale'], epsilon), params.get('bias')

  def convert(kernel, bias, dtype, use_bias):
    w = kernel.reshape(-1, kernel.shape[-1])
    if zero_sum:
      base.check_zero_sum(name.upper(), w)
    # scale * k / sqrt(|k|^2 + eps) with k = w: scale = sqrt(|w|^2 + eps)
    return base.with_layer_bias(
        {'kernel': jnp.asarray(kernel, dtype),
         'scale': jnp.asarray(np.sqrt(np.sum(w * w, axis=0) + epsilon), dtype)},
        bias, dtype, use_bias)

  def from_kernel(kernel, bias, use_bias):
    w = kernel.reshape(-1, kernel.shape[-1])
    out = {'kernel': kernel, 'scale': jnp.sqrt(jnp.sum(w * w, axis=0) + epsilon)}
    return {**out, 'bias': bias} if use_bias else out

  def bake(params, kernel_shape):
    del kernel_shape
    f64 = lambda n: np.asarray(meta.unbox(params[n]), np.float64)
    kernel = np.asarray(formula(f64('kernel'), f64('scale'), epsilon))
    return kernel, f64('bias') if 'bias' in params else None

  return base.Method(name, params, apply, convert, bake, min_fan_in, fan_in_reason,
                     from_kernel=from_kernel, linear_in='scale')


def wn(scale_init=jinit.ones, epsilon: float = 1e-12) -> base.Method:
  """Weight normalization as a `Method` (`scale_init`: the gain's initializer)."""
  return normed('wn', weight_norm, scale_init, epsilon)
