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

**LCW layers (paper 003 Sec. 3): Dense and Conv whose unit kernels sum to zero.**
Each output unit's kernel (for a conv: its flattened `K_1 x ... x K_d x C_in`
kernel) is `w = B_m v` (`geoparam.lcw.project`), with the trainable parameter
`v` of shape `(fan_in - 1, features)`, fan-in first like a Flax kernel. The
layers are drop-in replacements for `nn.Dense` / `nn.Conv` (same fields, same
padding/stride/dilation/group semantics); `B_m` is never formed.

`kernel_init` draws a kernel of the usual shape (so fan-based initializers see
the real fans) and `v` is its coordinates `B_m^T w`: the initial kernel is that
draw minus its per-unit mean.

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

from collections.abc import Callable
import math
from typing import Any

import flax.linen as nn
from flax.core import meta
import jax
import jax.numpy as jnp

from geoparam import checks
from geoparam import initializers
from geoparam.activations import prelu
from geoparam.linen import wrappers
from geoparam.methods.gmp import paper_method
from geoparam.normalization import batch_mean
from geoparam.normalization import check_floating
from geoparam.normalization import update_running_mean

__all__ = ['running_mean', 'InputMeanNorm', 'MeanOnlyBatchNorm', 'PReLU', 'GmPDense', 'GmPConv',
           'LCWDense', 'LCWConv', 'CWNDense', 'CWNConv', 'StandardizationLayer']

Array = jax.Array
Initializer = Callable[..., jax.Array]


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


# ----------------------------------------------------------------------------- GmP, the paper form

class _PaperGmP(nn.Module):
  """GmP's fields and the paper form's call, mixed into `nn.Dense`/`nn.Conv` (whose fields,
  `kernel_init` and `bias_init` aside, the layer keeps)."""

  activation: Callable[[jax.Array], jax.Array] | None = nn.relu
  input_mean_norm: bool = False
  use_running_average: bool | None = None
  momentum: float = 0.99
  axis_name: str | None = None
  theta_init: Initializer = initializers.sphere_uniform()
  lam_init: Initializer = nn.initializers.zeros
  scale_init: Initializer | None = None
  glorot_scale: bool = False
  reparameterized = True  # a reparameterized layer already: no whole-model transform's target

  @nn.compact
  def __call__(self, inputs, use_running_average: bool | None = None):
    """`scale * act(layer(inputs; u, lam))`, IMN included; the shapes of the plain layer."""
    layer = wrappers.plain(self)
    name = type(self).__name__
    for field in ('kernel_init', 'bias_init'):
      if getattr(self, field) is not getattr(type(layer), field):
        raise TypeError(f'{name}: {field} is not used (GmP draws its own parameters): set '
                        'theta_init, lam_init or scale_init, or wrap the plain layer with '
                        "geoparam.GmP(layer, initialization='layer') to convert its draw.")
    if isinstance(getattr(self, 'kernel_size', ()), int):  # one spatial dim, or a 3x3 meant?
      raise ValueError(f'{name}: kernel_size must be a tuple of positive ints, one per spatial '
                       f'dim, got {self.kernel_size!r}.')
    layout = wrappers.layout_of(layer, jax.numpy.shape(inputs), name)
    method = paper_method(self, math.prod(layout.method_shape[:-1]), name)
    y = wrappers.call(self, method, layer, inputs, use_running_average, self.use_running_average)
    if self.activation is not None:
      y = self.activation(y)
    y, scale = nn.dtypes.promote_dtype(y, meta.unbox(self.get_variable('params', 'scale')),
                                       dtype=self.dtype)
    return scale * y


class GmPDense(_PaperGmP, nn.Dense):
  """Dense layer in geometric parameterization: `scale * act(u(theta)^T x + lam)`.

  Example usage::

    >>> import jax, jax.numpy as jnp, geoparam
    >>> layer = geoparam.GmPDense(features=4)
    >>> params = layer.init(jax.random.key(0), jnp.ones((2, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'lam': (4,), 'scale': (4,), 'theta': (2, 4)}

  Attributes:
    features, use_bias, dtype, param_dtype, precision, dot_general: as `nn.Dense`
      (`use_bias=False`: no `lam`; `kernel_init`/`bias_init` are not used).
    activation: elementwise activation inside the scale (default relu); None for linear.
    input_mean_norm: centre the inputs first (IMN); then `use_running_average`
      is needed at call time and the running mean lives in `batch_stats`.
    use_running_average: as `nn.BatchNorm`, only used with `input_mean_norm`.
    momentum: running-mean decay for IMN.
    axis_name: named axis for a cross-device IMN mean (inside shard_map/pmap),
      as `nn.BatchNorm`.
    theta_init: initializer of the angles (uniform directions on the sphere).
    lam_init: initializer of `lam` (zeros).
    scale_init: initializer of `scale` (ones when None, or see `glorot_scale`).
    glorot_scale: when `scale_init` is None, start `scale` at the norm of a
      Glorot-uniform weight vector, as the paper's reference code does.
  """


class GmPConv(_PaperGmP, nn.Conv):
  """Convolution in geometric parameterization, any number of spatial dims.

  Each output channel's flattened kernel (`prod(kernel_size) * in_features //
  feature_group_count` entries, ordered like `nn.Conv`'s kernel) is `u(theta)`.
  Convolution semantics (padding, strides, dilation, groups, batch dims, mask) are
  exactly `nn.Conv`'s: the layer runs `nn.Conv` with the built kernel.

  Example usage::

    >>> import jax, jax.numpy as jnp, geoparam
    >>> layer = geoparam.GmPConv(features=8, kernel_size=(3, 3))
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 5, 5, 2)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'lam': (8,), 'scale': (8,), 'theta': (17, 8)}

  Attributes:
    features, kernel_size, strides, padding, input_dilation, kernel_dilation,
      feature_group_count, use_bias, mask, dtype, param_dtype, precision: as in `nn.Conv`.
    (other fields): as in `GmPDense`.
  """


# ----------------------------------------------------------------------------- LCW

class LCWDense(wrappers.PaperForm, nn.Dense):
  """A Dense layer with linearly constrained (zero-sum) weights: `nn.Dense`'s fields and semantics.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from geoparam.linen.layers import LCWDense
    >>> layer = LCWDense(features=4)
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (4,), 'v': (2, 4)}

  The fields are `nn.Dense`'s; `kernel_init` draws the (unconstrained) kernel
  `(fan_in, features)` and `v` is the coordinates of its zero-sum part.
  """

  _METHOD = 'lcw'


class LCWConv(wrappers.PaperForm, nn.Conv):
  """A convolution (any number of spatial dims) with zero-sum kernels per output channel.

  Same fields and semantics as `nn.Conv` (channels-last inputs
  `(*batch, *spatial, in_features)`); the kernel is built from `v` and applied
  through `nn.Conv` itself, so padding, strides, dilations and groups behave
  exactly as there. Each output channel's `K_1 x ... x K_d x (in_features //
  feature_group_count)` kernel sums to zero; `kernel_init` draws the unconstrained
  kernel and `v` is the coordinates of its per-channel zero-sum part.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from geoparam.linen.layers import LCWConv
    >>> layer = LCWConv(features=8, kernel_size=(3, 3))
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 5, 5, 2)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (8,), 'v': (17, 8)}
  """

  _METHOD = 'lcw'


# ----------------------------------------------------------------------------- baselines: CWN, SL

class _CWN(wrappers.PaperForm):
  """CWN's fields, mixed into `nn.Dense`/`nn.Conv`."""

  scale_init: nn.initializers.Initializer = nn.initializers.ones_init()
  epsilon: float = 1e-12
  _METHOD, _OPTIONS = 'cwn', ('scale_init', 'epsilon')


class CWNDense(_CWN, nn.Dense):
  """Dense layer with centered weight normalization: `nn.Dense`'s fields, plus CWN's.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from geoparam.linen.layers import CWNDense
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
