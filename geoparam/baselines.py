"""Baselines of paper 003 next to LCW: centered weight norm (CWN), standardization layer (SL).

* CWN (Huang et al. 2017): each unit's kernel is `w = g * c / |c|`, `c = k - mean(k)`
  (zero mean AND unit norm, times a gain `g`). Parameters: `kernel` (the
  unconstrained `k`, Flax kernel shape), `scale` (`g`, `(features,)`), `bias`.
* SL (Gulcehre & Bengio 2016): standardizes post-activations over the batch
  (no learned affine), with running statistics for inference, i.e. a
  `nn.BatchNorm` without scale and bias placed after the activation.
* Spectral normalization: use `nn.SpectralNorm(nn.Dense(...))` from Flax.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from geoparam.linen import wrappers
from geoparam.methods.cwn import centered_weight_norm
from geoparam.methods.wn import weight_norm

__all__ = ['weight_norm', 'centered_weight_norm', 'CWNDense', 'CWNConv', 'StandardizationLayer']

Array = jax.Array


class _CWN(wrappers.PaperForm):
  """CWN's fields, mixed into `nn.Dense`/`nn.Conv`."""

  scale_init: nn.initializers.Initializer = nn.initializers.ones_init()
  epsilon: float = 1e-12
  _METHOD, _OPTIONS = 'cwn', ('scale_init', 'epsilon')


class CWNDense(_CWN, nn.Dense):
  """Dense layer with centered weight normalization: `nn.Dense`'s fields, plus CWN's.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from geoparam.baselines import CWNDense
    >>> params = CWNDense(4).init(jax.random.key(0), jnp.ones((1, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (4,), 'kernel': (3, 4), 'scale': (4,)}

  The fields are `nn.Dense`'s, plus `scale_init` (the gain `g`'s initializer) and `epsilon`
  (added to the squared norm before the square root).
  """


class CWNConv(_CWN, nn.Conv):
  """Convolution with centered weight normalization (per output channel): `nn.Conv`'s fields and
  semantics, plus CWN's `scale_init` and `epsilon`."""


class StandardizationLayer(nn.Module):
  """SL: `(a - mean) / sqrt(var + epsilon)` over the batch, no learned parameters.

  Put it after the activation (BN normalizes pre-activations, SL activations).
  Running statistics live in `batch_stats` (`mean`, `var` under `norm`), used
  when `use_running_average` is True, as in `nn.BatchNorm`.

  Attributes:
    use_running_average: use the running statistics instead of the batch's.
    axis: the feature axis.
    momentum: decay of the running averages.
    epsilon: added to the variance.
    dtype: the dtype of the result (default: infer from input).
    param_dtype: dtype of the running statistics.
    axis_name: axis name for cross-device statistics (as `nn.BatchNorm`).
  """

  use_running_average: bool | None = None
  axis: int = -1
  momentum: float = 0.99
  epsilon: float = 1e-5
  dtype: Any = None
  param_dtype: Any = jnp.float32
  axis_name: str | None = None

  @nn.compact
  def __call__(self, x: Array, use_running_average: bool | None = None) -> Array:
    """Standardizes `x` per feature; `use_running_average` overrides the field."""
    use_running_average = nn.merge_param(
        'use_running_average', self.use_running_average, use_running_average)
    return nn.BatchNorm(
        use_running_average=use_running_average, axis=self.axis, momentum=self.momentum,
        epsilon=self.epsilon, dtype=self.dtype, param_dtype=self.param_dtype,
        use_bias=False, use_scale=False, axis_name=self.axis_name, name='norm')(x)
