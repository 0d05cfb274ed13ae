"""Linen modules of their own: IMN, mean-only batch norm (MBN) and PReLU (paper 001).

IMN and MBN subtract a mean over every axis but the feature (last) axis: the
batch mean while training, a running mean (collection `batch_stats`) in
evaluation, switched by `use_running_average` exactly like `nn.BatchNorm`
(`geoparam.normalization` holds the pure functions, shared with NNX). IMN
centres the INPUTS of a layer, no learned parameters; MBN (Salimans & Kingma,
2016) centres PRE-activations and adds a learned bias (the WN+MBN baseline).
PReLU's slopes start at 0.25 and should not be weight-decayed
(`geoparam.masks.decay_mask`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from geoparam.activations import check_slope
from geoparam.activations import prelu
from geoparam.normalization import batch_mean
from geoparam.normalization import check_floating
from geoparam.normalization import check_momentum
from geoparam.normalization import update_running_mean
from geoparam.selection import check_flag

__all__ = ['running_mean', 'InputMeanNorm', 'MeanOnlyBatchNorm', 'PReLU']


def running_mean(module: nn.Module, x: jax.Array, use_running_average: bool,
                 momentum: float = 0.99, axis_name: str | None = None,
                 name: str = 'mean') -> jax.Array:
  """The mean to subtract from `x`, shape `(features,)`, kept in `module`'s `batch_stats`.

  Training (`use_running_average=False`): the batch mean over every axis but the
  last; the running mean `batch_stats/<name>` is updated as
  `m <- momentum * m + (1 - momentum) * batch_mean` (not while initializing).
  Evaluation: the running mean. Call it from inside a module's compact method.
  """
  check_momentum(momentum)
  check_floating(x)
  stat_dtype = jnp.promote_types(x.dtype, jnp.float32)
  ra_mean = module.variable(
      'batch_stats', name, lambda s: jnp.zeros(s, stat_dtype), (x.shape[-1],))
  if use_running_average:
    return ra_mean.value
  # Like nn.BatchNorm: no cross-device mean while initializing (outside shard_map/pmap).
  mean = batch_mean(x, None if module.is_initializing() else axis_name)
  if not module.is_initializing():
    ra_mean.value = update_running_mean(ra_mean.value, mean, momentum)
  return mean


class InputMeanNorm(nn.Module):
  """Input mean normalization: `x - E[x]` per feature, no learned parameters.

  Example usage::

    >>> import jax, jax.numpy as jnp, geoparam
    >>> imn = geoparam.InputMeanNorm()
    >>> x = jnp.arange(6.).reshape(3, 2)
    >>> v = imn.init(jax.random.key(0), x, use_running_average=False)
    >>> jax.tree.map(jnp.shape, v)
    {'batch_stats': {'mean': (2,)}}
    >>> y, upd = imn.apply(v, x, use_running_average=False, mutable=['batch_stats'])
    >>> y.mean(0)
    Array([0., 0.], dtype=float32)

  Attributes:
    use_running_average: if True, subtract the running mean (evaluation); if
      False, the batch mean (training) and update the running mean.
    momentum: decay of the running mean: `m <- momentum * m + (1 - momentum) * batch_mean`.
    axis_name: optional named axis to average the batch mean over (shard_map/pmap).
  """

  use_running_average: bool | None = None
  momentum: float = 0.99
  axis_name: str | None = None

  @nn.compact
  def mean(self, x, use_running_average: bool | None = None):
    """The mean IMN subtracts from `x` `(..., features)`: shape `(features,)`.

    GmP layers call this to fold the mean into their bias.
    """
    use_running_average = nn.merge_param(
        'use_running_average', self.use_running_average, use_running_average)
    return running_mean(self, jnp.asarray(x), use_running_average, self.momentum, self.axis_name)

  def __call__(self, x, use_running_average: bool | None = None):
    """Centres `x` of shape `(..., features)` over all but the last axis."""
    x = jnp.asarray(x)
    return x - self.mean(x, use_running_average).astype(x.dtype)


class MeanOnlyBatchNorm(nn.Module):
  """Mean-only batch normalization: `x - E[x] + bias` per feature (Salimans & Kingma).

  Example usage::

    >>> import jax, jax.numpy as jnp, geoparam
    >>> mbn = geoparam.MeanOnlyBatchNorm()
    >>> v = mbn.init(jax.random.key(0), jnp.ones((4, 3)), use_running_average=False)
    >>> jax.tree.map(jnp.shape, v)
    {'batch_stats': {'mean': (3,)}, 'params': {'bias': (3,)}}

  Attributes:
    use_running_average: as in `nn.BatchNorm`.
    momentum: decay of the running mean.
    axis_name: optional named axis for the batch mean (shard_map/pmap).
    use_bias: whether to add the learned bias.
    bias_init: initializer of the bias (zeros).
    param_dtype: dtype of the bias.
  """

  use_running_average: bool | None = None
  momentum: float = 0.99
  axis_name: str | None = None
  use_bias: bool = True
  bias_init: Any = nn.initializers.zeros
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None):
    """Centres pre-activations `x` of shape `(..., features)` and adds the bias."""
    x = jnp.asarray(x)
    use_running_average = nn.merge_param(
        'use_running_average', self.use_running_average, use_running_average)
    y = x - running_mean(self, x, use_running_average, self.momentum, self.axis_name).astype(x.dtype)
    if self.use_bias:
      bias = self.param('bias', self.bias_init, (x.shape[-1],), self.param_dtype)
      y = y + bias.astype(y.dtype)
    return y


class PReLU(nn.Module):
  """Parametric ReLU with a learned negative slope (parameter `negative_slope`).

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from geoparam import PReLU
    >>> params = PReLU().init(jax.random.key(0), jnp.ones((2, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'negative_slope': (3,)}

  Attributes:
    channel_shared: one scalar slope for all channels (True) or one slope per
      feature along the last axis (False, the default).
    negative_slope_init: initial slope, a finite float (paper 001: 0.25).
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype of the slope parameter.
  """

  channel_shared: bool = False
  negative_slope_init: float = 0.25
  dtype: jnp.dtype | None = None
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    """Applies PReLU elementwise; `inputs` has shape `(..., C)`."""
    check_slope(self.negative_slope_init)
    check_flag('channel_shared', self.channel_shared, 'PReLU')
    if self.channel_shared:
      shape = ()
    else:
      if jnp.ndim(inputs) < 1:
        raise ValueError(
            'PReLU with channel_shared=False needs inputs with a channel (last) axis, '
            f'got shape {jnp.shape(inputs)}.')
      shape = (jnp.shape(inputs)[-1],)
    slope = self.param(
        'negative_slope', nn.initializers.constant(self.negative_slope_init), shape,
        self.param_dtype)
    inputs, slope = nn.dtypes.promote_dtype(inputs, slope, dtype=self.dtype)
    return prelu(inputs, slope)
