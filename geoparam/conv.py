"""Shared machinery of the reparameterized convolutions (GmPConv, LCWConv, CWNConv).

Each of them validates its input the same way, builds a kernel of shape
`(*kernel_size, in_features // groups, features)` from its own parameters, and
runs `nn.Conv` with that kernel, so padding, strides, dilation, groups and batch
dimensions are exactly `nn.Conv`'s.
"""

from __future__ import annotations

import numbers
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


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


def apply(module: Any, params: dict[str, jax.Array], inputs: jax.Array) -> jax.Array:
  """Runs `nn.Conv` with `module`'s conv fields and the given `kernel` (and optional `bias`)."""
  kernel = params['kernel']
  conv = nn.Conv(
      features=kernel.shape[-1],
      kernel_size=tuple(kernel.shape[:-2]),
      strides=module.strides,
      padding=module.padding,
      input_dilation=module.input_dilation,
      kernel_dilation=module.kernel_dilation,
      feature_group_count=module.feature_group_count,
      use_bias='bias' in params,
      dtype=module.dtype,
      param_dtype=module.param_dtype,
      precision=module.precision,
      parent=None)
  return conv.apply({'params': params}, jnp.asarray(inputs))
