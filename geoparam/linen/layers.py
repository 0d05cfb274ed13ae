"""The linen layers: the paper forms (GmP, LCW), the baselines (CWN, SL) and IMN, MBN, PReLU.

**Layers of their own: IMN, mean-only batch norm (MBN) and PReLU (paper 001).**
IMN and MBN subtract a mean over every axis but the feature (last) axis: the
batch mean while training, a running mean (collection `batch_stats`) in
evaluation, switched by `use_running_average` exactly like `nn.BatchNorm`
(`geoparam.normalization` holds the pure functions, shared with NNX). IMN
centres the INPUTS of a layer, no learned parameters; MBN (Salimans & Kingma,
2016) centres PRE-activations and adds a learned bias (the WN+MBN baseline).
PReLU's slopes start at 0.25 and should not be weight-decayed
(`geoparam.masks.decay_mask`).

**Geometric parameterization (GmP) layers in the paper's form, paper 002 eq. (15)-(16).**
The `gmp` method (`geoparam.methods.gmp`) with the scale outside the activation:
the layer runs `nn.Dense`/`nn.Conv` with the kernel `u(theta)` and bias `lam`
(`geoparam.linen.wrappers.call`, the same code as every wrapper), then applies the
activation and multiplies by `scale`. A GmP unit computes `scale * act(u(theta)^T x + lam)`:
`u(theta)` is the unit direction of eq. (10), `lam` the signed distance of the activation boundary
from the origin and `scale` the paper's `r`. With `input_mean_norm=True` the
input is centred first (IMN, eq. 16; `geoparam.methods.run.forward`). Running
mean in `batch_stats/input_mean_norm/mean`.

Parameters (collection `params`):

  theta: `(fan_in - 1, features)`, fan-in first like a Flax kernel.
  lam:   `(features,)`.
  scale: `(features,)`.
  sign:  `(features,)`, only when fan_in == 1: the direction is a sign, fixed at
         init; it receives no gradient (`stop_gradient`) and only its sign is
         used, so weight decay cannot flip it.

    >>> import jax, jax.numpy as jnp, geoparam
    >>> layer = geoparam.GmPConv(features=8, kernel_size=(3, 3), glorot_scale=True)
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 5, 5, 2)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'lam': (8,), 'scale': (8,), 'theta': (17, 8)}

**LCW layers (paper 003 Sec. 3): Dense and Conv whose unit kernels sum to zero.**
Each output unit's kernel (for a conv: its flattened `K_1 x ... x K_d x C_in`
kernel) is `w = B_m v` (`geoparam.lcw.project`), with the trainable parameter
`v` of shape `(fan_in - 1, features)`, fan-in first like a Flax kernel. The
layers are drop-in replacements for `nn.Dense` / `nn.Conv` (same fields, same
padding/stride/dilation/group semantics); `B_m` is never formed.

`kernel_init` draws a kernel of the usual shape (so fan-based initializers see
the real fans) and `v` is its coordinates `B_m^T w`: the initial kernel is that
draw minus its per-unit mean.

    >>> params = geoparam.LCWDense(4).init(jax.random.key(0), jnp.ones((1, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (4,), 'v': (2, 4)}

**Baselines of paper 003 next to LCW: centered weight norm (CWN), standardization layer (SL).**

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

from geoparam import checks
from geoparam.activations import prelu
from geoparam import methods
from geoparam.linen import wrappers
from geoparam.normalization import batch_mean
from geoparam.normalization import check_floating
from geoparam.normalization import update_running_mean

__all__ = ['running_mean', 'InputMeanNorm', 'MeanOnlyBatchNorm', 'PReLU', 'GmPDense', 'GmPConv',
           'LCWDense', 'LCWConv', 'CWNDense', 'CWNConv', 'StandardizationLayer']

Array = jax.Array


# ----------------------------------------------------------------------------- IMN, MBN, PReLU

def running_mean(module: nn.Module, x: jax.Array, use_running_average: bool,
                 momentum: float = 0.99, axis_name: str | None = None,
                 name: str = 'mean') -> jax.Array:
  """The mean to subtract from `x`, shape `(features,)`, kept in `module`'s `batch_stats`.

  Training (`use_running_average=False`): the batch mean over every axis but the
  last; the running mean `batch_stats/<name>` is updated as
  `m <- momentum * m + (1 - momentum) * batch_mean` (not while initializing).
  Evaluation: the running mean. Call it from inside a module's compact method.
  """
  checks.momentum(momentum)
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
    checks.real('negative_slope_init', self.negative_slope_init, owner='PReLU')
    checks.flag('channel_shared', self.channel_shared, 'PReLU')
    if not self.channel_shared and jnp.ndim(inputs) < 1:
      raise ValueError('PReLU with channel_shared=False needs inputs with a channel (last) axis, '
                       f'got shape {jnp.shape(inputs)}.')
    shape = () if self.channel_shared else (jnp.shape(inputs)[-1],)
    slope = self.param(
        'negative_slope', nn.initializers.constant(self.negative_slope_init), shape,
        self.param_dtype)
    inputs, slope = nn.dtypes.promote_dtype(inputs, slope, dtype=self.dtype)
    return prelu(inputs, slope)


# ----------------------------------------------------------------------------- the paper forms

# GmPDense, GmPConv (`scale * act(u(theta)^T x + lam)`), LCWDense, LCWConv, CWNDense, CWNConv:
# `nn.Dense`/`nn.Conv`'s fields and semantics, plus the options of their method
# (`geoparam.methods.PAPER_FORMS`) as fields.
GmPDense, GmPConv, LCWDense, LCWConv, CWNDense, CWNConv = (
    wrappers.paper_form(name + layer.__name__, factory, layer, __name__)
    for name, factory in methods.PAPER_FORMS.items() for layer in (nn.Dense, nn.Conv))



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
    return nn.BatchNorm(  # which merges the field and the argument
        use_running_average=self.use_running_average, axis=self.axis, momentum=self.momentum,
        epsilon=self.epsilon, dtype=self.dtype, param_dtype=self.param_dtype,
        use_bias=False, use_scale=False, axis_name=self.axis_name, name='norm')(
            x, use_running_average)
