"""The mean IMN (paper 002 eq. 16) and mean-only batch norm (MBN) subtract, as pure functions.

The linen modules are `geoparam.InputMeanNorm` and `geoparam.MeanOnlyBatchNorm`
(`geoparam.linen.layers`), the NNX ones `geoparam.nnx.InputMeanNorm` and
`geoparam.nnx.MeanOnlyBatchNorm`; both call these.

Both subtract a mean over every axis but the feature (last) axis: the batch
mean while training, a running mean (collection `batch_stats`) in evaluation,
switched by `use_running_average` exactly like `nn.BatchNorm`.

- IMN centres the INPUTS of a layer and has no learned parameters.
- MBN (Salimans & Kingma, 2016) centres PRE-activations and adds a learned bias;
  it is the companion of weight normalization in the WN+MBN baseline.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ['batch_mean', 'update_running_mean', 'mean_step', 'check_floating']


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
