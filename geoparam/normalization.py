"""Input mean normalization (IMN, paper 002 eq. 16) and mean-only batch norm (MBN).

Both subtract a mean over every axis but the feature (last) axis: the batch
mean while training, a running mean (collection `batch_stats`) in evaluation,
switched by `use_running_average` exactly like `nn.BatchNorm`.

- IMN centres the INPUTS of a layer and has no learned parameters.
- MBN (Salimans & Kingma, 2016) centres PRE-activations and adds a learned bias;
  it is the companion of weight normalization in the WN+MBN baseline.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ['batch_mean', 'update_running_mean', 'mean_step', 'check_floating', 'running_mean', 'InputMeanNorm', 'MeanOnlyBatchNorm']


def batch_mean(x: jax.Array, axis_name: str | None = None) -> jax.Array:
  """Mean of `x` over every axis but the last, shape `(features,)`, in float32 or wider.

  With `axis_name` (inside `shard_map`/`pmap`) the mean is also averaged over
  that named axis. Under `jax.jit` with a sharded batch, the plain mean is
  already the global mean.
  """
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(f'expected inputs of shape (..., batch, features), got shape {x.shape}.')
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  mean = jnp.mean(x.astype(dtype), axis=tuple(range(x.ndim - 1)))
  if axis_name is not None:
    mean = jax.lax.pmean(mean, axis_name)
  return mean


def update_running_mean(running: jax.Array, batch: jax.Array, momentum: float) -> jax.Array:
  """`momentum * running + (1 - momentum) * batch`: the running mean after one training batch."""
  return momentum * running + (1.0 - momentum) * batch


def mean_step(running: jax.Array, x: jax.Array, use_running_average: bool, momentum: float,
              axis_name: str | None = None) -> tuple[jax.Array, jax.Array]:
  """`(mean to subtract, new running mean)` for `x (..., F)`, pure (the NNX modules' step).

  Evaluation: the running mean, unchanged; training: the batch mean and the updated one.

    >>> import jax.numpy as jnp
    >>> mean_step(jnp.zeros(2), jnp.array([[1.0, 3.0]]), False, 0.5)
    (Array([1., 3.], dtype=float32), Array([0.5, 1.5], dtype=float32))
  """
  check_floating(x)
  if use_running_average:
    return running, running
  mean = batch_mean(x, axis_name)
  return mean, update_running_mean(running, mean, momentum)


def check_floating(x: jax.Array) -> None:
  """The mean normalizations need floating inputs: raises a TypeError naming the dtype."""
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    raise TypeError(f'the mean normalizations need floating inputs, got dtype {x.dtype} (the '
                    'mean would be truncated to it): cast integer images to float first.')


def running_mean(module: nn.Module, x: jax.Array, use_running_average: bool,
                 momentum: float = 0.99, axis_name: str | None = None,
                 name: str = 'mean') -> jax.Array:
  """The mean to subtract from `x`, shape `(features,)`, kept in `module`'s `batch_stats`.

  Training (`use_running_average=False`): the batch mean over every axis but the
  last; the running mean `batch_stats/<name>` is updated as
  `m <- momentum * m + (1 - momentum) * batch_mean` (not while initializing).
  Evaluation: the running mean. Call it from inside a module's compact method.
  """
  if not 0.0 <= momentum <= 1.0:
    raise ValueError(f'momentum must be in [0, 1], got {momentum}.')
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
