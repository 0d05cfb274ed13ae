"""Layer kinds as records: what a Flax layer type contributes, once for linen and NNX.

A method (`geoparam.methods`) sees a kernel `(*fan_in_axes, F)`: the units on
its last axis. A layer kind says how its own kernel maps to that (`Layout`:
which kernel axes are the units, which the fan-in), how to read its fields,
which input axes IMN averages over and whether IMN's fold is exact for it. The
linen and NNX shells register their classes here (`register`) and read the
records; nothing else dispatches on a layer's type. A new layer kind is one
`Kind` and one `register` call.

    >>> from geoparam import kinds
    >>> layout = kinds.einsum_layout('btd,ndh->btnh', (4, 16, 8))
    >>> layout.units, layout.method_shape      # units: n, h (in the output); fan-in: d
    ((4, 8), (16, 32))

This module imports no Flax framework: layers are read by their fields.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import math
from typing import Any, NamedTuple

import numpy as np

from geoparam import checks

__all__ = ['Layout', 'Kind', 'Shell', 'register', 'of', 'kind_of', 'layout_of', 'REGISTRY',
           'DENSE', 'CONV', 'GENERAL', 'EINSUM', 'CONV_TRANSPOSE', 'einsum_layout',
           'conv_kernel_shape', 'features_of', 'ints']

Shape = tuple[int, ...]


class Layout(NamedTuple):
  """A layer's kernel `kernel_shape` and which of its axes index the units (`unit_axes`).

  The method sees `(*fan_in dims, prod(unit dims))` (`method_shape`): the fan-in
  axes in their order, then the units flattened in `unit_axes` order (the order
  of the layer's bias).

    >>> import numpy as np
    >>> layout = Layout((3, 4, 5), unit_axes=(0, 2))     # e.g. 'xd,ndh->xnh'
    >>> layout.method_shape, layout.fan_in_axes
    ((4, 15), (1,))
    >>> k = np.arange(60.0).reshape(3, 4, 5)
    >>> bool((layout.to_layer(layout.to_method(k))[0] == k).all())
    True
  """
  kernel_shape: Shape
  unit_axes: Shape

  @property
  def fan_in_axes(self) -> Shape:
    return tuple(a for a in range(len(self.kernel_shape)) if a not in self.unit_axes)

  @property
  def units(self) -> Shape:
    """The unit axes' sizes: the shape of the layer's bias."""
    return tuple(self.kernel_shape[a] for a in self.unit_axes)

  @property
  def method_shape(self) -> Shape:
    return tuple(self.kernel_shape[a] for a in self.fan_in_axes) + (math.prod(self.units),)

  @property
  def _order(self) -> Shape:
    return self.fan_in_axes + self.unit_axes

  def to_method(self, kernel):
    """The layer's kernel (jax or numpy) as the method sees it, `method_shape`."""
    return kernel.transpose(self._order).reshape(self.method_shape)

  def to_layer(self, kernel, bias=None):
    """`(kernel, bias)` of the method (`method_shape`, `(F,)` or None) in the layer's layout."""
    kernel = kernel.reshape(tuple(self.kernel_shape[a] for a in self._order))
    return (kernel.transpose(tuple(np.argsort(self._order))),
            None if bias is None else bias.reshape(self.units))

  def names(self, names):
    """Sharding names of the layer's kernel, relabelled for the method's: the flattened units
    take the first unit axis's name (`('embed', 'heads', 'kv')` -> `('embed', 'heads')`).
    Fewer names than axes name the leading ones, as a `PartitionSpec` does (Flax accepts them)."""
    if names is None:
      return None
    names = tuple(names) + (None,) * (len(self.kernel_shape) - len(names))
    return tuple(names[a] for a in self.fan_in_axes) + (names[self.unit_axes[0]],)


class Kind(NamedTuple):
  """What a layer kind contributes.

  Attributes:
    name: for messages (`'Dense'`, `'Conv'`, ...).
    layout: `layout(layer, inputs_shape) -> Layout` of the kernel the layer builds
      for inputs of this shape; raises ValueError for settings it cannot support.
    imn_axes: `imn_axes(layer, ndim) -> axes`: the input axes IMN's mean is taken
      per position of (the fan-in's input axes, a conv's window aside), in the
      kernel's fan-in order; raises ValueError where IMN has no exact form.
    example_shape: `example_shape(layer) -> shape` of a small input, from the
      fields of a layer that knows its input width (NNX's).
    padding_free: `padding_free(layer) -> bool`: `layer(x - m) == layer(x) - w^T m`
      at every output (a conv that pads or inserts no zeros); IMN's running mean
      then converts into the bias exactly.
    taps: IMN's fold goes through the conv's tap mask (`geoparam.conv`).
    kernel: the name of the kernel variable; bias: of the bias.
    has_bias: `has_bias(layer) -> bool`.
    refused: why a layer of this kind cannot be reparameterized at all ('' if it can).
  """
  name: str
  layout: Callable[[Any, Shape], Layout] | None = None
  imn_axes: Callable[[Any, int], Shape] | None = None
  example_shape: Callable[[Any], Shape] | None = None
  padding_free: Callable[[Any], bool] = lambda layer: True
  taps: bool = False
  kernel: str = 'kernel'
  bias: str = 'bias'
  has_bias: Callable[[Any], bool] = lambda layer: bool(getattr(layer, 'use_bias', True))
  refused: str = ''


#: Layer class -> `Kind`; the shells register the Flax classes, users their own.
REGISTRY: dict[type, Kind] = {}


def register(kind: Kind, *classes: type) -> None:
  """Makes `classes` (and their subclasses) layers of `kind` for every wrapper and transform."""
  if not isinstance(kind, Kind):
    raise TypeError(f'kind must be a geoparam.kinds.Kind, got {type(kind).__name__}.')
  for cls in classes:
    if not isinstance(cls, type):
      raise TypeError(f'register takes layer classes, got {cls!r}.')
    REGISTRY[cls] = kind


def of(layer) -> Kind | None:
  """The kind of `layer` (by its class or a base class), or None (also for geoparam's own
  reparameterized layers, `LCWDense` and the like: class attribute `reparameterized`)."""
  if getattr(type(layer), 'reparameterized', False):
    return None
  return next((REGISTRY[c] for c in type(layer).__mro__ if c in REGISTRY), None)


class Shell(NamedTuple):
  """A framework's layers, for messages: `base` their class, `label` what they are called
  (`'an NNX layer'`) and `other`: where the other framework's layers go."""
  base: type
  label: str
  other: str


def _shown(cls: type) -> str:
  """`nn.Dense`, `nnx.Linear`, or a user class's own name."""
  prefix = {'flax.linen': 'nn.', 'flax.nnx': 'nnx.'}
  return next((p for m, p in prefix.items() if cls.__module__.startswith(m)), '') + cls.__name__


def kind_of(layer, name: str, shell: Shell | None = None) -> Kind:
  """`of(layer)`; a TypeError naming `name` for a layer of no (or a refused) kind, or not of
  `shell`'s framework.

    >>> import flax.linen as nn
    >>> import geoparam.linen  # the linen shell registers nn.Dense, nn.Conv, ...
    >>> kind_of(nn.Dense(3), 'layer').name
    'Dense'
    >>> kind_of(nn.Embed(3, 4), 'layer')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: layer cannot be reparameterized: accepted layer types are ...nn.Dense, nn.Conv, ...
  """
  if shell is not None and not isinstance(layer, shell.base):
    raise TypeError(f'{name}: takes {shell.label}, got a {type(layer).__module__}.'
                    f'{type(layer).__name__} ({shell.other}).')
  kind = of(layer)
  if kind is None or kind.refused:
    base = object if shell is None else shell.base
    accepted = [_shown(c) for c, k in REGISTRY.items() if not k.refused and issubclass(c, base)]
    why = f' ({kind.refused})' if kind is not None else ''
    raise TypeError(f'{name} cannot be reparameterized{why}: accepted layer types are '
                    f'{", ".join(accepted)} (geoparam.kinds.register adds one).')
  return kind


def layout_of(layer, inputs_shape, name: str, shell: Shell | None = None) -> Layout:
  """`kind_of(layer, ...).layout(layer, inputs_shape)`, its errors naming `name`."""
  kind = kind_of(layer, name, shell)
  try:
    layout = kind.layout(layer, tuple(inputs_shape))
  except ValueError as e:
    raise ValueError(f'{name}: {e}') from None
  if not isinstance(layout, Layout):
    raise TypeError(f'{name}: the layout of its kind {kind.name!r} returned {layout!r:.60} of type '
                    f'{type(layout).__name__}, not a geoparam.kinds.Layout(kernel_shape, '
                    'unit_axes).')
  return layout


# ----------------------------------------------------------------------------- fields

def ints(value) -> Shape:
  """An int (or any scalar) or a sequence of them as a tuple."""
  return tuple(value) if isinstance(value, (Sequence, np.ndarray)) else (value,)


def features_of(layer) -> Shape:
  """The output features (linen `features`, NNX `out_features`) as a tuple of ints, each
  checked to be >= 1 (`geoparam.checks.count`)."""
  features = getattr(layer, 'features', None)
  features = ints(layer.out_features if features is None else features)
  return tuple(checks.count('features', f, 1, type(layer).__name__) for f in features)


def _last_axis(layer, ndim: int) -> Shape:
  return (ndim - 1,)


def _trailing(kernel_shape, n_units) -> Layout:
  k = len(kernel_shape)
  return Layout(tuple(kernel_shape), tuple(range(k - n_units, k)))


# ----------------------------------------------------------------------------- Dense / Linear

def _dense_layout(layer, inputs_shape):
  if len(inputs_shape) < 1:
    raise ValueError('expects inputs (..., fan_in), got a scalar.')
  return _trailing((inputs_shape[-1],) + features_of(layer), 1)


#: `nn.Dense` and `nnx.Linear`: kernel `(fan_in, F)`.
DENSE = Kind('Dense', _dense_layout, _last_axis,
             example_shape=lambda layer: (1, layer.in_features))


# ----------------------------------------------------------------------------- DenseGeneral

def _general_axes(layer, ndim):
  return tuple(a % ndim for a in ints(layer.axis))


def _general_layout(layer, inputs_shape):
  batch = getattr(layer, 'batch_dims', None) or getattr(layer, 'batch_axis', None)
  if batch:
    raise ValueError(f'one kernel per batch entry (batch_dims/batch_axis={batch!r}) cannot be '
                     'reparameterized; exclude it.')
  features = features_of(layer)
  axes = _general_axes(layer, len(inputs_shape))
  return _trailing(tuple(inputs_shape[a] for a in axes) + features, len(features))


def _general_example(layer):
  axes = ints(layer.axis)
  ndim = max([len(axes) + 1] + [a + 1 for a in axes if a >= 0] + [-a for a in axes if a < 0])
  shape = [1] * ndim
  for a, n in zip(axes, ints(layer.in_features)):
    shape[a] = n
  return tuple(shape)


#: `nn.DenseGeneral` and `nnx.LinearGeneral`: kernel `(*contracted, *features)`.
GENERAL = Kind('DenseGeneral', _general_layout, _general_axes, _general_example)


# ----------------------------------------------------------------------------- Conv

def conv_kernel_shape(kernel_size, inputs_shape, features: int, groups: int) -> Shape:
  """Checks a conv's arguments against its input; `(*kernel_size, in // groups, features)`.

  Raises a ValueError naming the bad argument for non-positive kernel sizes, inputs of too
  low rank for `kernel_size`, and a `feature_group_count` not dividing both widths.
  """
  kernel_size = tuple(checks.count('kernel_size', k, 1) for k in ints(kernel_size))
  if not kernel_size:
    raise ValueError('needs a kernel_size, one int per spatial dim, got ().')
  num_spatial = len(kernel_size)
  if len(inputs_shape) < num_spatial + 1:
    raise ValueError(
        f'kernel_size {kernel_size} has {num_spatial} spatial dims, so inputs need rank >= '
        f'{num_spatial + 1} (*batch, *spatial, features); got shape {tuple(inputs_shape)}.')
  in_features = inputs_shape[-1]
  if groups < 1 or in_features % groups or features % groups:
    raise ValueError(
        f'needs feature_group_count >= 1 dividing both in_features = {in_features} and '
        f'features = {features}, got feature_group_count = {groups}.')
  return kernel_size + (in_features // groups, features)


def _conv_layout(layer, inputs_shape):
  return _trailing(conv_kernel_shape(layer.kernel_size, inputs_shape, features_of(layer)[0],
                                     layer.feature_group_count), 1)


def _padding_free(layer) -> bool:
  dilation = getattr(layer, 'input_dilation', None)
  if dilation is not None and any(d != 1 for d in np.atleast_1d(dilation)):
    return False
  padding = layer.padding
  if isinstance(padding, str):
    return padding.upper() in ('VALID', 'CIRCULAR', 'REFLECT')
  return not np.any(np.asarray(padding))


def _conv_example(layer):
  kernel_size = ints(layer.kernel_size)
  dilation = ints(layer.kernel_dilation or 1)
  dilation = dilation * len(kernel_size) if len(dilation) == 1 else dilation
  return (1,) + tuple((k - 1) * d + 1 for k, d in zip(kernel_size, dilation)) + (
      layer.in_features,)


#: `nn.Conv` and `nnx.Conv`: kernel `(*window, in // groups, F)`; IMN exact at padded borders.
CONV = Kind('Conv', _conv_layout, _last_axis, _conv_example, _padding_free, taps=True)


# ----------------------------------------------------------------------------- ConvTranspose

def _conv_transpose_layout(layer, inputs_shape):
  shape = conv_kernel_shape(layer.kernel_size, inputs_shape, features_of(layer)[0], 1)
  if getattr(layer, 'transpose_kernel', False):  # (*window, features, in)
    return Layout(shape[:-2] + (shape[-1], shape[-2]), (len(shape) - 2,))
  return _trailing(shape, 1)


def _no_imn(why):
  def imn_axes(layer, ndim):
    raise ValueError(f'IMN has no exact form for a {type(layer).__name__}: {why}.')
  return imn_axes


#: `nn.ConvTranspose` and `nnx.ConvTranspose`: every method without IMN.
CONV_TRANSPOSE = Kind(
    'ConvTranspose', _conv_transpose_layout,
    _no_imn("a unit's weights are spread over the output positions, so `x - m` is not one bias "
            'per unit; use a method without IMN (gmp, lcw, wn, cwn)'),
    lambda layer: (1,) + (1,) * len(ints(layer.kernel_size)) + (layer.in_features,),
    padding_free=lambda layer: False)


# ----------------------------------------------------------------------------- Einsum

def _einsum_specs(einsum_str):
  if not isinstance(einsum_str, str):
    raise ValueError(f'needs its einsum_str as a field (a string like "btd,dh->bth"), got '
                     f'{einsum_str!r}.')
  s = einsum_str.replace(' ', '')
  if '->' not in s or s.count(',') != 1:
    raise ValueError(f'einsum_str must be explicit with two operands, "input,kernel->output", '
                     f'got {einsum_str!r}.')
  operands, out = s.split('->')
  x, k = operands.split(',')
  if '.' in k:
    raise ValueError(f'einsum_str {einsum_str!r}: an ellipsis in the kernel operand is not '
                     'supported.')
  if len(set(k)) != len(k):  # a diagonal: the layer reads only part of the kernel
    raise ValueError(f'einsum_str {einsum_str!r}: a kernel axis letter repeats, so the einsum '
                     "reads only the kernel's diagonal and no unit has all of its weights; not "
                     'supported.')
  return x, k, out


def einsum_layout(einsum_str: str, kernel_shape: Sequence[int]) -> Layout:
  """The `Layout` of an einsum's kernel: the kernel axes that appear in the output are the
  units (in the output's order: the bias's), the others the fan-in.

    >>> einsum_layout('btd,dnh->btnh', (8, 2, 4)).method_shape
    (8, 8)
  """
  _, k, out = _einsum_specs(einsum_str)
  if len(k) != len(kernel_shape):
    raise ValueError(f'einsum_str {einsum_str!r} names {len(k)} kernel axes, but the kernel '
                     f'shape is {tuple(kernel_shape)}.')
  units = tuple(k.index(c) for c in out if c in k)
  if not units:
    raise ValueError(f'einsum_str {einsum_str!r}: no kernel axis reaches the output, so it has '
                     'no units.')
  return Layout(tuple(kernel_shape), units)


def _einsum_shape(layer):
  shape = getattr(layer, 'shape', None)
  return ints(layer.kernel_shape if shape is None else shape)


def _einsum_layout(layer, inputs_shape):
  del inputs_shape
  return einsum_layout(layer.einsum_str, _einsum_shape(layer))


def _input_positions(x: str, ndim: int) -> dict[str, int]:
  if '...' not in x:
    return {c: i for i, c in enumerate(x)}
  left, right = x.split('...')
  return {**{c: i for i, c in enumerate(left)},
          **{c: ndim - len(right) + j for j, c in enumerate(right)}}


def _einsum_imn_axes(layer, ndim):
  x, k, out = _einsum_specs(layer.einsum_str)
  fan_in = [c for c in k if c not in out]
  why = None
  if any(c not in x for c in fan_in):
    why = 'a fan-in axis of the kernel is not an axis of the input'
  elif any(c in x for c in k if c in out):
    why = 'a unit axis of the kernel is also an input axis (each unit sees its own input)'
  elif any(c not in k and c not in out for c in x.replace('.', '')):
    why = 'an input axis is summed without the kernel'
  if why:
    raise ValueError(f'IMN has no exact form for the einsum {layer.einsum_str!r}: {why}.')
  positions = _input_positions(x, ndim)
  return tuple(positions[c] for c in fan_in)


def _einsum_example(layer):
  x, k, _ = _einsum_specs(layer.einsum_str)
  sizes = dict(zip(k, _einsum_shape(layer)))
  return tuple(sizes.get(c, 1) for c in x.replace('.', ''))


def _einsum_has_bias(layer):
  use_bias = getattr(layer, 'use_bias', None)
  return bool(use_bias) if use_bias is not None else getattr(layer, 'bias', None) is not None


#: `nn.Einsum` and `nnx.Einsum`: units and fan-in from the einsum string.
EINSUM = Kind('Einsum', _einsum_layout, _einsum_imn_axes, _einsum_example,
              has_bias=_einsum_has_bias)
