"""IMN's exact fold for convolutions, framework-neutral: `conv(x - mu) = conv(x) - conv(mu * 1)`.

The second term is the conv of one constant image: a bias `(F,)` plus a
correction at the output positions whose windows hold padded or inserted zeros
(`split`, `subtract_at`). What each kernel tap sees of an image of ones
(`tap_mask`) is found by running the layer itself (a probe each shell gives), so
padding, strides and dilations are Flax's by construction.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import math
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from geoparam import kinds

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


def _hashable(value):
  if isinstance(value, (list, tuple)):
    return tuple(_hashable(v) for v in value)
  if isinstance(value, np.ndarray):
    return _hashable(value.tolist())
  return value


_TAP_MASKS: dict[Any, np.ndarray] = {}


def tap_mask(layer: Any, spatial_in: tuple[int, ...], probe) -> np.ndarray:
  """What each kernel tap sees of a constant image of ones: `(*spatial_out, taps)`, float32.

  `mask[p, t]` is the value that tap `t` (kernel positions in C order) of output
  position `p` reads from the layer's padded and input-dilated image of ones:
  1 inside the image, 0 on padded zeros and on zeros inserted by input dilation,
  1 on wrapped or reflected pixels. Found by running the layer itself (its
  padding, strides, dilations; one channel, one one-hot kernel per tap), so it
  is Flax's semantics by construction; concrete (computed at trace time, cached).

  `layer` is a linen or NNX conv (its fields key the cache); `probe(kernel, ones)
  -> outputs` runs it with this kernel, one input and `taps` output channels, no
  groups, mask or bias, in float32 at HIGHEST precision (each shell has one).
  """
  kernel_size = kinds.ints(layer.kernel_size)
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
    mask = np.array(probe(eye, ones)[0])
  if key is not None and len(_TAP_MASKS) < 4096:
    _TAP_MASKS[key] = mask
  return mask


def tap_products(kernel, mean, xp=jnp, **einsum_options):
  """`w_{t,f}^T m`: each tap `t` of a conv kernel `(*window, C_in / groups, F)` against the mean
  `m` `(C_in,)` of its unit's group of channels, `(taps, F)`; `xp`: `jnp`, or `np` in float64."""
  taps, group_in, features = math.prod(kernel.shape[:-2]), kernel.shape[-2], kernel.shape[-1]
  groups = mean.shape[-1] // group_in
  k = kernel.reshape(taps, group_in, groups, features // groups)
  return xp.einsum('tcgh,gc->tgh', k, mean.reshape(groups, group_in),
                   **einsum_options).reshape(taps, features)


def split(tap_mask_: np.ndarray, kernel: jax.Array, mean: jax.Array, precision=None,
          kernel_mask=None) -> tuple[jax.Array, np.ndarray, jax.Array]:
  """IMN's conv fold: `conv(mean * 1)` as `(flat, positions, correction)`, from the conv's
  `tap_mask` `(*spatial_out, taps)`: `flat` `(F,)` at every output position whose window
  holds no padded or inserted zero, and `flat + correction[i]` at the flat output position
  `positions[i]` (numpy ints, known at trace time; the border of a 'SAME' conv). The layers
  subtract `flat` with the bias and `correction` at `positions` only (`subtract_at`).

  `kernel_mask`: the conv's `mask` over its kernel, or None.
  """
  dtype = jnp.promote_types(jnp.promote_types(kernel.dtype, mean.dtype), jnp.float32)
  if kernel_mask is not None:
    kernel = kernel * jnp.asarray(kernel_mask, kernel.dtype)
  per_tap = tap_products(kernel.astype(dtype), mean.astype(dtype), precision=precision)
  mask = tap_mask_.reshape(-1, per_tap.shape[0])
  positions = np.flatnonzero(np.any(mask != 1, axis=1))
  correction = jnp.tensordot((mask[positions] - 1).astype(dtype), per_tap, axes=1,
                             precision=precision)
  return per_tap.sum(0), positions, correction


def subtract_at(z: jax.Array, positions: np.ndarray, values: jax.Array,
                num_spatial: int) -> jax.Array:
  """`z` `(*batch, *spatial, F)` with `values` `(n, F)` subtracted at the flat spatial
  `positions` `(n,)` (of `split`), every batch element; `z` itself if there are none."""
  if positions.size == 0:
    return z
  shape = z.shape
  flat = z.reshape((-1, math.prod(shape[-num_spatial - 1:-1]), shape[-1]))
  return flat.at[:, positions, :].add(-values.astype(z.dtype)).reshape(shape)
