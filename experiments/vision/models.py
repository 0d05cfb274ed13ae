"""Vision models of the studies: ResNet-50 (paper 002 Table 1), VGG-6 (002 Table 2), and
VGG19 / pre-activation ResNet18 for CIFAR (paper 003 Table 1), each with a `parameterization`.

- `ResNet` (`ResNet50`: stages 3, 4, 6, 3): He et al. (2016) bottleneck ResNet,
  stride on the first 1x1 conv of a block as in the paper (v1), projection
  shortcuts where the shape changes. Parameterizations are paper 002's
  `models.METHODS`. Every conv+BN pair becomes one unit (`ConvUnit`): `bn` conv
  (no bias) + BN; `wn_mbn` WN conv (no bias) + mean-only BN; `sp` / `wn` conv
  with bias; `gmp` / `gmp_imn` one `GmPConv` (its `lam` is the bias, its
  `scale` the gain). Units followed by a ReLU keep it (inside the GmP unit);
  the last conv of a block and the projection stay linear before the residual
  sum (GmP with `activation=None`, still function-equal to an SP conv). With
  `gmp_imn` every GmP conv except the stem centres its inputs (IMN, running
  means in `batch_stats`), as paper 002 App. C.1 pairs IMN with GmP and MBN
  with WN.
- `vgg6(...)`: paper 002's VGG-6, i.e. `experiments.lib.models.CNN` with
  `VGG6_LAYERS` scaled by a width multiplier (not a second implementation).
- `VGG19` and `PreActResNet18` for CIFAR (paper 003 Sec. 6.2): VGG19 has 16
  3x3 convs, then two hidden dense layers with dropout and the output; the
  ResNet18 is the full pre-activation one (He et al. 2016b) with BN-ReLU
  before each conv and a final BN-ReLU. Parameterizations (`CIFAR_PARAMETERIZATIONS`):
  `sp` plain, no BN; `bn` plain + BN (paper 003's "VGG19" / "ResNet18");
  `lcw` LCW, no BN; `bn_lcw` LCW + BN ("+LCW"); `bn_wn`, `bn_cwn`, `bn_sn` the
  weight normalizations of paper 003 Table 1, applied like LCW to the BN models
  (so they keep BN; rows of `experiments.lib.models.PARAMETERIZATIONS`). Weights of
  every conv and hidden dense layer use the parameterization; convs carry a bias
  only when no BN follows.

Every model: a `width` multiplier on all channel counts (`round(c * width)`,
at least 1) for reduced runs, and a plain `nn.Dense` output named `out`. Its
parameterized layers come from the studies' one factory, `models.layer`
(`ConvUnit`) and its weight part `models.weights` (`WeightLayer`).
Layers are named alike across parameterizations (`conv` inside each unit), so
`geoparam.convert.sp_to_gmp` maps an `sp` checkpoint onto `gmp`.

`create_model(config, num_classes)` builds any of them (and `cnn`) from a
training config (`config.model`, `config.method`, `config.width`, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from experiments.lib import models

RESNET_PARAMETERIZATIONS = models.METHODS
# Paper 003's CNN methods, rows of `models.PARAMETERIZATIONS` (WN, CWN and SN keep BN there).
CIFAR_PARAMETERIZATIONS = ('sp', 'bn', 'lcw', 'bn_lcw', 'bn_wn', 'bn_cwn', 'bn_sn')
MODELS = ('cnn', 'vgg6', 'resnet50', 'resnet', 'vgg19', 'preact_resnet18')
VGG19_LAYERS = (64, 64, 'M', 128, 128, 'M', 256, 256, 256, 256, 'M',
                512, 512, 512, 512, 'M', 512, 512, 512, 512, 'M')

he = nn.initializers.he_normal()


def check_parameterization(name: str, accepted: Sequence[str]) -> str:
  if name not in accepted:
    raise ValueError(f'unknown parameterization {name!r}; accepted: {", ".join(accepted)}.')
  return name


def _cifar_row(name: str) -> tuple[str, bool]:
  """(weight kind, batch norm before each ReLU) of a paper-003 CNN method."""
  row = models.PARAMETERIZATIONS[check_parameterization(name, CIFAR_PARAMETERIZATIONS)]
  return row.weights, row.norm == 'bn'


def scaled(channels: int, width: float) -> int:
  """`round(channels * width)`, at least 1."""
  if not width > 0:
    raise ValueError(f'width must be > 0, got {width!r}.')
  return max(1, int(round(channels * width)))


def scale_layers(layers: Sequence[Any], width: float) -> tuple[Any, ...]:
  """A `CNN` layer list (ints and 'M') with every width scaled."""
  return tuple(l if l == 'M' else scaled(l, width) for l in layers)


def vgg6(num_classes: int, parameterization: str = 'sp', width: float = 1.0,
         **kwargs) -> models.CNN:
  """Paper 002's VGG-6 (`models.CNN` with `VGG6_LAYERS`) at a width multiplier.

  `parameterization` is one of `models.METHODS` (the CNN's `method` field);
  other keyword arguments go to `models.CNN` (`bn_momentum`, `dtype`, ...).
  """
  check_parameterization(parameterization, models.METHODS)
  return models.CNN(num_classes=num_classes, layers=scale_layers(models.VGG6_LAYERS, width),
                    method=parameterization, **kwargs)


# ---------------------------------------------------------------------------
# ResNet-50 (paper 002 Table 1).


class ConvUnit(nn.Module):
  """Conv + normalization (+ ReLU) in one of paper 002's parameterizations.

  Attributes:
    features: output channels.
    kernel_size: spatial kernel size.
    strides: conv strides.
    padding: as `nn.Conv`.
    parameterization: one of `models.METHODS`.
    relu: apply a ReLU (inside the GmP unit for `gmp*`); False for the linear
      convs before a residual sum.
    intermediate: the input is a hidden activation (IMN applies with `gmp_imn`);
      False for the stem, which sees the normalized image.
    bn_momentum: running-average momentum of BN/MBN/IMN.
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """

  features: int
  kernel_size: Sequence[int] = (3, 3)
  strides: Sequence[int] = (1, 1)
  padding: Any = 'SAME'
  parameterization: str = 'bn'
  relu: bool = True
  intermediate: bool = True
  bn_momentum: float = 0.9
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    p = check_parameterization(self.parameterization, models.METHODS)
    return models.layer(x, p, self.features, name='conv', names=models.PART_NAMES, train=train,
                        first=not self.intermediate, activation=nn.relu if self.relu else None,
                        kernel_size=tuple(self.kernel_size), strides=tuple(self.strides),
                        padding=self.padding, kernel_init=he, momentum=self.bn_momentum,
                        bn_epsilon=1e-5, dtype=self.dtype, param_dtype=self.param_dtype)


class Bottleneck(nn.Module):
  """He et al. (2016) bottleneck: 1x1 (stride), 3x3, 1x1 (4x), projection when shapes differ.

  Attributes:
    features: bottleneck width (the block outputs `4 * features`).
    strides: stride of the first 1x1 conv and of the projection.
    unit: `ConvUnit` partial carrying the parameterization and dtypes.
  """

  features: int
  strides: Sequence[int] = (1, 1)
  unit: Any = ConvUnit

  @nn.compact
  def __call__(self, x, train: bool = False):
    y = self.unit(self.features, (1, 1), self.strides, name='conv1')(x, train)
    y = self.unit(self.features, (3, 3), name='conv2')(y, train)
    y = self.unit(4 * self.features, (1, 1), relu=False, name='conv3')(y, train)
    if x.shape[-1] != y.shape[-1] or tuple(self.strides) != (1, 1):
      x = self.unit(4 * self.features, (1, 1), self.strides, relu=False, name='proj')(x, train)
    return nn.relu(y + x)


class ResNet(nn.Module):
  """Bottleneck ResNet for 224x224 (or any size) images; `ResNet50` is stages (3, 4, 6, 3).

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> m = ResNet(num_classes=10, stage_sizes=(1, 1), width=1 / 16, parameterization='gmp_imn')
    >>> v = jax.eval_shape(m.init, jax.random.key(0), jnp.ones((2, 32, 32, 3)))
    >>> jax.tree.map(jnp.shape, v['batch_stats'])['stage0_block0']['conv1']
    {'conv': {'input_mean_norm': {'mean': (4,)}}}

  Attributes:
    num_classes: output width (plain Dense `out`).
    stage_sizes: blocks per stage (widths 64, 128, 256, 512 times `width`).
    parameterization: one of `models.METHODS`.
    width: channel multiplier.
    bn_momentum: running-average momentum of BN/MBN/IMN.
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """

  num_classes: int
  stage_sizes: Sequence[int] = (3, 4, 6, 3)
  parameterization: str = 'bn'
  width: float = 1.0
  bn_momentum: float = 0.9
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    check_parameterization(self.parameterization, RESNET_PARAMETERIZATIONS)
    unit = functools.partial(ConvUnit, parameterization=self.parameterization,
                             bn_momentum=self.bn_momentum, dtype=self.dtype,
                             param_dtype=self.param_dtype)
    x = unit(scaled(64, self.width), (7, 7), (2, 2), padding=((3, 3), (3, 3)),
             intermediate=False, name='stem')(x, train)
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for i, blocks in enumerate(self.stage_sizes):
      for j in range(blocks):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = Bottleneck(scaled(64 * 2**i, self.width), strides, unit=unit,
                       name=f'stage{i}_block{j}')(x, train)
    x = jnp.mean(x, axis=(-3, -2))
    return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype,
                    name='out')(x)


ResNet50 = functools.partial(ResNet, stage_sizes=(3, 4, 6, 3))


# ---------------------------------------------------------------------------
# CIFAR models of paper 003 (VGG19, pre-activation ResNet18).


class WeightLayer(nn.Module):
  """A conv (`kernel_size` given) or dense layer whose weights use a paper-003 parameterization.

  The weight layer of `models.weights` (`kind` looked up in `models.WEIGHTS`),
  named `layer` (its wrapper `wn` / `sn`) inside this module.

  Attributes:
    features: output width.
    kind: 'plain', 'lcw', 'wn', 'cwn' or 'sn' (a row's `weights`).
    kernel_size: spatial kernel size, or None for a dense layer.
    strides: conv strides.
    use_bias: add a bias (False when BN follows).
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """

  features: int
  kind: str = 'plain'
  kernel_size: Sequence[int] | None = None
  strides: Sequence[int] = (1, 1)
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    conv = self.kernel_size is not None
    return models.weights(x, self.kind, self.features, name='layer', names=models.PART_NAMES,
                          train=train, use_bias=self.use_bias,
                          kernel_size=tuple(self.kernel_size) if conv else None,
                          strides=tuple(self.strides), padding='SAME', kernel_init=he,
                          dtype=self.dtype, param_dtype=self.param_dtype)


def _batch_norm(module, name):
  return nn.BatchNorm(momentum=module.bn_momentum, epsilon=1e-5, dtype=module.dtype,
                      param_dtype=module.param_dtype, name=name)


class VGG19(nn.Module):
  """VGG19 for CIFAR (paper 003 Sec. 6.2): 16 3x3 convs, two hidden dense layers with dropout.

  Conv widths `VGG19_LAYERS` (max pools at 'M'), flattened, then dense
  `fc_features` twice (ReLU, dropout), then the plain output. With BN
  (see `CIFAR_PARAMETERIZATIONS`) a BN precedes each ReLU. Conv `i` is
  `conv_{i}` (its BN `conv_{i}_bn`), dense `fc_{j}`.

  Dropout needs a `'dropout'` rng when training with `dropout_rate > 0`.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> m = VGG19(num_classes=10, parameterization='bn_lcw', width=1 / 16)
    >>> v = jax.eval_shape(m.init, jax.random.key(0), jnp.ones((1, 32, 32, 3)))
    >>> jax.tree.map(jnp.shape, v['params'])['conv_1']
    {'layer': {'v': (35, 4)}}

  Attributes:
    num_classes: output width.
    parameterization: one of `CIFAR_PARAMETERIZATIONS`.
    width: channel multiplier (also of `fc_features`).
    fc_features: width of the two hidden dense layers.
    dropout_rate: dropout after each hidden dense layer (paper 003: dropout; 0.5 here).
    bn_momentum: BN running-average momentum.
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """

  num_classes: int
  parameterization: str = 'bn'
  width: float = 1.0
  fc_features: int = 512
  dropout_rate: float = 0.5
  bn_momentum: float = 0.9
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    kind, use_bn = _cifar_row(self.parameterization)
    layer = functools.partial(WeightLayer, kind=kind, use_bias=not use_bn, dtype=self.dtype,
                              param_dtype=self.param_dtype)
    i = 0
    for entry in VGG19_LAYERS:
      if entry == 'M':
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        continue
      x = layer(scaled(entry, self.width), kernel_size=(3, 3), name=f'conv_{i}')(x, train)
      if use_bn:
        x = _batch_norm(self, f'conv_{i}_bn')(x, use_running_average=not train)
      x = nn.relu(x)
      i += 1
    x = x.reshape(x.shape[:-3] + (-1,))
    for j in range(2):
      x = layer(scaled(self.fc_features, self.width), name=f'fc_{j}')(x, train)
      if use_bn:
        x = _batch_norm(self, f'fc_{j}_bn')(x, use_running_average=not train)
      x = nn.relu(x)
      x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
    return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype,
                    name='out')(x)


class PreActBlock(nn.Module):
  """Pre-activation basic block (He et al. 2016b): BN-ReLU-conv3x3-BN-ReLU-conv3x3 + shortcut.

  The shortcut is the identity, or a 1x1 conv (same parameterization) of the
  pre-activated input when the shape changes. Without BN the BN steps are
  left out (ReLU only).
  """

  features: int
  strides: Sequence[int] = (1, 1)
  kind: str = 'plain'
  use_bn: bool = True
  bn_momentum: float = 0.9
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    layer = functools.partial(WeightLayer, kind=self.kind, use_bias=not self.use_bn,
                              dtype=self.dtype, param_dtype=self.param_dtype)
    y = _batch_norm(self, 'bn1')(x, use_running_average=not train) if self.use_bn else x
    y = nn.relu(y)
    shortcut = x
    if x.shape[-1] != self.features or tuple(self.strides) != (1, 1):
      shortcut = layer(self.features, kernel_size=(1, 1), strides=self.strides, name='proj')(
          y, train)
    y = layer(self.features, kernel_size=(3, 3), strides=self.strides, name='conv1')(y, train)
    if self.use_bn:
      y = _batch_norm(self, 'bn2')(y, use_running_average=not train)
    y = nn.relu(y)
    y = layer(self.features, kernel_size=(3, 3), name='conv2')(y, train)
    return y + shortcut


class PreActResNet18(nn.Module):
  """Pre-activation ResNet18 for CIFAR (paper 003 Sec. 6.2): 3x3 stem, 4 stages of 2 blocks.

  Stage widths 64, 128, 256, 512 (times `width`), strides 1, 2, 2, 2; a final
  BN-ReLU, global average pool and the plain output `out`.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> m = PreActResNet18(num_classes=10, parameterization='bn_cwn', width=1 / 16)
    >>> y = jax.eval_shape(m.init_with_output, jax.random.key(0), jnp.ones((2, 32, 32, 3)))[0]
    >>> y.shape
    (2, 10)

  Attributes:
    num_classes: output width.
    parameterization: one of `CIFAR_PARAMETERIZATIONS`.
    width: channel multiplier.
    stage_sizes: blocks per stage ((2, 2, 2, 2) is ResNet18).
    bn_momentum: BN running-average momentum.
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """

  num_classes: int
  parameterization: str = 'bn'
  width: float = 1.0
  stage_sizes: Sequence[int] = (2, 2, 2, 2)
  bn_momentum: float = 0.9
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    kind, use_bn = _cifar_row(self.parameterization)
    x = WeightLayer(scaled(64, self.width), kind=kind, kernel_size=(3, 3), use_bias=not use_bn,
                    dtype=self.dtype, param_dtype=self.param_dtype, name='stem')(x, train)
    for i, blocks in enumerate(self.stage_sizes):
      for j in range(blocks):
        x = PreActBlock(scaled(64 * 2**i, self.width), (2, 2) if i > 0 and j == 0 else (1, 1),
                        kind=kind, use_bn=use_bn, bn_momentum=self.bn_momentum, dtype=self.dtype,
                        param_dtype=self.param_dtype, name=f'stage{i}_block{j}')(x, train)
    if use_bn:
      x = _batch_norm(self, 'final_bn')(x, use_running_average=not train)
    x = jnp.mean(nn.relu(x), axis=(-3, -2))
    return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype,
                    name='out')(x)


# ---------------------------------------------------------------------------
# From a training config.


def create_model(config, num_classes: int) -> nn.Module:
  """The model of a training config: `config.model` in `MODELS`, `config.method` its
  parameterization, optional `config.width` (default 1), `config.stage_sizes` (ResNets),
  `config.dropout_rate` (VGG19), `config.bn_momentum`.
  """
  name, method = config.model, config.method
  width = config.get('width', 1.0)
  momentum = config.get('bn_momentum', 0.9)
  if name == 'cnn':
    models.check_methods([method])
    return models.CNN(num_classes=num_classes, layers=scale_layers(config.layers, width),
                      method=method, bn_momentum=momentum)
  if name == 'vgg6':
    return vgg6(num_classes, method, width, bn_momentum=momentum)
  if name in ('resnet50', 'resnet'):
    stages = (3, 4, 6, 3) if name == 'resnet50' else tuple(config.stage_sizes)
    return ResNet(num_classes=num_classes, stage_sizes=stages, parameterization=method,
                  width=width, bn_momentum=momentum)
  if name == 'vgg19':
    return VGG19(num_classes=num_classes, parameterization=method, width=width,
                 dropout_rate=config.get('dropout_rate', 0.5), bn_momentum=momentum)
  if name == 'preact_resnet18':
    return PreActResNet18(num_classes=num_classes, parameterization=method, width=width,
                          stage_sizes=tuple(config.get('stage_sizes', (2, 2, 2, 2))),
                          bn_momentum=momentum)
  raise ValueError(f'unknown model {name!r}; accepted: {", ".join(MODELS)}.')
