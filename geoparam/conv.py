"""Shared machinery of the reparameterized convolutions (GmPConv, LCWConv, CWNConv).

Each of them validates its input the same way, builds a kernel of shape
`(*kernel_size, in_features // groups, features)` from its own parameters, and
runs `nn.Conv` with that kernel, so padding, strides, dilation, groups and batch
dimensions are exactly `nn.Conv`'s.

`imn_bias` is IMN for convolutions without a pass over the activations (used by
`GmPConv` and `geoparam.GmP(nn.Conv)`): the conv is linear, so
`conv(x - mu) = conv(x) - conv(mu * 1)`, and the second term is the same conv
of one constant image.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import math
import numbers
import threading
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

_bypass = threading.local()


@contextlib.contextmanager
def bypass() -> Iterator[None]:
  """Marks the layer calls inside as the library's own: whole-model interceptors step aside."""
  _bypass.active = getattr(_bypass, 'active', 0) + 1
  try:
    yield
  finally:
    _bypass.active -= 1


def bypassed() -> bool:
  """True inside `bypass()` (while the library runs a layer of its own)."""
  return getattr(_bypass, 'active', 0) > 0


def kernel_shape(layer: str, kernel_size: tuple[int, ...], inputs_shape: tuple[int, ...],
                 features: int, groups: int) -> tuple[int, ...]:
  """Checks a conv's arguments against its input; returns `(*kernel_size, in // groups, features)`.

  Raises a ValueError naming `layer` and the bad argument for non-positive kernel sizes, inputs
  of too low rank for `kernel_size`, and a `feature_group_count` not dividing both widths.
  """
  if not kernel_size or not all(isinstance(k, numbers.Integral) and k >= 1 for k in kernel_size):
    raise ValueError(
        f'{layer} needs kernel_size of positive ints, one per spatial dim, got {kernel_size!r}.')
  num_spatial = len(kernel_size)
  if len(inputs_shape) < num_spatial + 1:
    raise ValueError(
        f'{layer}: kernel_size {kernel_size} has {num_spatial} spatial dims, so inputs need '
        f'rank >= {num_spatial + 1} (*batch, *spatial, features); got shape {inputs_shape}.')
  in_features = inputs_shape[-1]
  if groups < 1 or in_features % groups or features % groups:
    raise ValueError(
        f'{layer} needs feature_group_count >= 1 dividing both in_features = {in_features} '
        f'and features = {features}, got feature_group_count = {groups}.')
  return tuple(kernel_size) + (in_features // groups, features)


def layer_of(module: Any, kernel_shape: tuple[int, ...], use_bias: bool = False) -> nn.Conv:
  """The unbound `nn.Conv` with `module`'s conv fields for a kernel of `kernel_shape`."""
  return nn.Conv(
      features=kernel_shape[-1],
      kernel_size=tuple(kernel_shape[:-2]),
      strides=module.strides,
      padding=module.padding,
      input_dilation=module.input_dilation,
      kernel_dilation=module.kernel_dilation,
      feature_group_count=module.feature_group_count,
      use_bias=use_bias,
      dtype=module.dtype,
      param_dtype=module.param_dtype,
      precision=module.precision,
      parent=None)


def apply(module: Any, params: dict[str, jax.Array], inputs: jax.Array) -> jax.Array:
  """Runs `nn.Conv` with `module`'s conv fields and the given `kernel` (and optional `bias`)."""
  conv = layer_of(module, params['kernel'].shape, 'bias' in params)
  with bypass():
    return conv.apply({'params': params}, jnp.asarray(inputs))


def _hashable(value):
  if isinstance(value, (list, tuple)):
    return tuple(_hashable(v) for v in value)
  if isinstance(value, np.ndarray):
    return _hashable(value.tolist())
  return value


_TAP_MASKS: dict[Any, np.ndarray] = {}


def tap_mask(layer: Any, spatial_in: tuple[int, ...], probe=None) -> np.ndarray:
  """What each kernel tap sees of a constant image of ones: `(*spatial_out, taps)`, float32.

  `mask[p, t]` is the value that tap `t` (kernel positions in C order) of output
  position `p` reads from the layer's padded and input-dilated image of ones:
  1 inside the image, 0 on padded zeros and on zeros inserted by input dilation,
  1 on wrapped or reflected pixels. Found by running the layer itself (its
  padding, strides, dilations; one channel, one one-hot kernel per tap), so it
  is Flax's semantics by construction; concrete (computed at trace time, cached).

  `layer` is a linen `nn.Conv`, or any conv with the same fields (`nnx.Conv`)
  when `probe(kernel, ones) -> outputs` runs it with this kernel, one input and
  `taps` output channels, no groups, mask or bias, in float32 at HIGHEST precision.
  """
  kernel_size = layer.kernel_size
  kernel_size = (kernel_size,) if isinstance(kernel_size, numbers.Integral) else tuple(
      kernel_size)
  spatial_in = tuple(int(s) for s in spatial_in)
  key = (type(layer), kernel_size, spatial_in) + tuple(
      _hashable(getattr(layer, f, None)) for f in (
          'strides', 'padding', 'input_dilation', 'kernel_dilation', 'conv_general_dilated',
          'conv_general_dilated_cls'))
  try:
    cached = _TAP_MASKS.get(key)
  except TypeError:  # an unhashable field: compute every time
    key, cached = None, None
  if cached is not None:
    return cached
  taps = math.prod(kernel_size)
  eye = np.eye(taps, dtype=np.float32).reshape(kernel_size + (1, taps))
  ones = np.ones((1,) + spatial_in + (1,), np.float32)
  with jax.ensure_compile_time_eval(), bypass():
    mask = np.array((probe or _linen_probe(layer, kernel_size, taps))(eye, ones)[0])
  if key is not None and len(_TAP_MASKS) < 4096:
    _TAP_MASKS[key] = mask
  return mask


def _linen_probe(layer, kernel_size, taps):
  """`probe` of `tap_mask` for a linen `nn.Conv`."""
  # kernel_init: flax checks a given param's shape against its initializer's.
  probe = layer.clone(parent=None, name=None, features=taps, kernel_size=kernel_size,
                      feature_group_count=1, use_bias=False, mask=None, dtype=jnp.float32,
                      param_dtype=jnp.float32, precision=lax.Precision.HIGHEST,
                      kernel_init=nn.initializers.zeros)
  return lambda kernel, ones: probe.apply({'params': {'kernel': kernel}}, ones)


def imn_bias(layer: nn.Conv, kernel: jax.Array, mean: jax.Array,
             inputs_shape: tuple[int, ...]) -> jax.Array:
  """`conv(mean * 1)`: what IMN subtracts from `conv(x)`, so `conv(x - mean) = conv(x) - this`.

  The conv of one constant image, exact at padded borders (for every padding,
  stride, dilation and group count), computed from the per-tap products
  `w_t^T mean` and `tap_mask` in `(*spatial_out) * taps * features` multiply-adds,
  not a pass over the activations.

  Args:
    layer: the `nn.Conv` (its fields; its `mask` field, if any, applies to `kernel`).
    kernel: `(*kernel_size, in_features // groups, features)`, as the layer uses it.
    mean: `(in_features,)`, the mean subtracted from every input position.
    inputs_shape: the shape of the layer's input `(*batch, *spatial_in, in_features)`.

  Returns:
    `(features,)` when every output position sees a full window of the image (no
    zero padded or inserted: 'VALID', 'CIRCULAR', 'REFLECT', zero pads, 1x1
    'SAME'), i.e. `w^T mean` to fold into the bias like a dense layer's; else
    `(*spatial_out, features)`, broadcasting against the conv's output. In the
    dtype of `kernel` and `mean` promoted, float32 at least.

  A 3x3 'SAME' conv of ones: a corner window holds 4 pixels, an edge one 6, the interior 9.

    >>> import jax.numpy as jnp, flax.linen as nn, geoparam
    >>> b = geoparam.conv.imn_bias(nn.Conv(1, (3, 3)), jnp.ones((3, 3, 1, 1)), jnp.ones(1),
    ...                            (8, 4, 4, 1))
    >>> b.shape, b[..., 0].tolist()[:2]
    ((4, 4, 1), [[4.0, 6.0, 6.0, 4.0], [6.0, 9.0, 9.0, 6.0]])
    >>> geoparam.conv.imn_bias(nn.Conv(1, (3, 3), padding='CIRCULAR'), jnp.ones((3, 3, 1, 1)),
    ...                        jnp.ones(1), (8, 4, 4, 1))  # no zeros padded: one bias
    Array([9.], dtype=float32)
  """
  flat, positions, correction = imn_split(layer, kernel, mean, inputs_shape)
  if positions.size == 0:
    return flat
  num_spatial = kernel.ndim - 2
  spatial_out = tap_mask(layer, tuple(inputs_shape[-num_spatial - 1:-1])).shape[:-1]
  full = jnp.broadcast_to(flat, (math.prod(spatial_out), flat.shape[-1]))
  return full.at[positions].add(correction).reshape(spatial_out + flat.shape[-1:])


def imn_split(layer: nn.Conv, kernel: jax.Array, mean: jax.Array,
              inputs_shape: tuple[int, ...]) -> tuple[jax.Array, np.ndarray, jax.Array]:
  """`imn_bias` as `(flat, positions, correction)`: `conv(mean * 1)` is `flat` `(F,)` at every
  output position whose window holds no padded or inserted zero, and `flat + correction[i]` at
  the flat output position `positions[i]` (numpy ints into `spatial_out`, known at trace time;
  the border of a 'SAME' conv). The layers subtract `flat` with the bias and `correction` at
  `positions` only (`subtract_at`): a per-position bias over the whole output costs an extra
  pass (~8% of a 3x3 128-channel conv step on CPU).

  A 3x3 'SAME' conv of a 4x4 image: the 12 border positions differ from the interior's 9.

    >>> import jax.numpy as jnp, flax.linen as nn, geoparam
    >>> flat, positions, correction = geoparam.conv.imn_split(
    ...     nn.Conv(1, (3, 3)), jnp.ones((3, 3, 1, 1)), jnp.ones(1), (8, 4, 4, 1))
    >>> flat.tolist(), positions.tolist(), correction[:4, 0].tolist()
    ([9.0], [0, 1, 2, 3, 4, 7, 8, 11, 12, 13, 14, 15], [-5.0, -3.0, -3.0, -5.0])
    >>> z = jnp.zeros((2, 4, 4, 1))
    >>> geoparam.conv.subtract_at(z, positions, correction, 2)[0, :2, :, 0].tolist()
    [[5.0, 3.0, 3.0, 5.0], [3.0, 0.0, 0.0, 3.0]]
  """
  num_spatial = kernel.ndim - 2
  mask = tap_mask(layer, tuple(inputs_shape[-num_spatial - 1:-1]))
  return split(mask, kernel, mean, layer.precision, layer.mask)


def split(tap_mask_: np.ndarray, kernel: jax.Array, mean: jax.Array, precision=None,
          kernel_mask=None) -> tuple[jax.Array, np.ndarray, jax.Array]:
  """`imn_split` from a conv's `tap_mask` `(*spatial_out, taps)` (any framework's conv).

  `kernel_mask`: the conv's `mask` over its kernel, or None.
  """
  taps, group_in, features = math.prod(kernel.shape[:-2]), kernel.shape[-2], kernel.shape[-1]
  groups = mean.shape[-1] // group_in
  dtype = jnp.promote_types(jnp.promote_types(kernel.dtype, mean.dtype), jnp.float32)
  if kernel_mask is not None:
    kernel = kernel * jnp.asarray(kernel_mask, kernel.dtype)
  # per_tap[t, f] = sum_c kernel[t, c, f] * mean[group(f) * group_in + c]
  k = kernel.astype(dtype).reshape(taps, group_in, groups, features // groups)
  per_tap = jnp.einsum('tcgh,gc->tgh', k, mean.astype(dtype).reshape(groups, group_in),
                       precision=precision).reshape(taps, features)
  mask = tap_mask_.reshape(-1, taps)
  positions = np.flatnonzero(np.any(mask != 1, axis=1))
  correction = jnp.tensordot((mask[positions] - 1).astype(dtype), per_tap, axes=1,
                             precision=precision)
  return per_tap.sum(0), positions, correction


def subtract_at(z: jax.Array, positions: np.ndarray, values: jax.Array,
                num_spatial: int) -> jax.Array:
  """`z` `(*batch, *spatial, F)` with `values` `(n, F)` subtracted at the flat spatial
  `positions` `(n,)` (of `imn_split`), every batch element; `z` itself if there are none."""
  if positions.size == 0:
    return z
  shape = z.shape
  flat = z.reshape((-1, math.prod(shape[-num_spatial - 1:-1]), shape[-1]))
  return flat.at[:, positions, :].add(-values.astype(z.dtype)).reshape(shape)
