"""Models of the studies, with the parameterization chosen by name.

Methods (paper 002): `sp` (plain Dense), `wn` (weight normalization),
`wn_mbn` (WN + mean-only batch norm on pre-activations), `bn` (batch norm on
pre-activations), `gmp` (geometric parameterization), `gmp_imn` (GmP with input
mean normalization on every hidden layer after the first). The output layer is
always a plain Dense, as in the paper.

Hidden layers are named `hidden_{i}` and the output `out` for every method, so
`geoparam.convert.sp_to_gmp` maps an `sp` checkpoint onto a `gmp` model.
Dense kernels start Glorot-uniform with zero bias (the reference code's Keras
defaults); BN uses Keras' epsilon 1e-3 and momentum 0.99.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

import geoparam

METHODS = ('sp', 'wn', 'wn_mbn', 'bn', 'gmp', 'gmp_imn')

glorot = nn.initializers.glorot_uniform()


def check_methods(methods: Sequence[str]) -> tuple[str, ...]:
  """Returns the methods as a tuple; unknown names raise a ValueError listing the accepted ones."""
  methods = tuple(m.strip().lower() for m in methods if m.strip())
  unknown = [m for m in methods if m not in METHODS]
  if unknown or not methods:
    raise ValueError(f'unknown methods {unknown or methods}; accepted: {", ".join(METHODS)}.')
  return methods


class MLP(nn.Module):
  """ReLU MLP whose hidden layers use the parameterization `method`.

  Attributes:
    hidden: widths of the hidden layers.
    out: output width.
    method: one of `METHODS`.
    gmp_glorot_scale: start GmP scales at the Glorot norm (reference code) instead of 1.
    param_dtype: parameter dtype (float64 for the toy studies).
  """

  hidden: Sequence[int]
  out: int
  method: str = 'sp'
  gmp_glorot_scale: bool = False
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    check_methods([self.method])
    pd = self.param_dtype
    for i, width in enumerate(self.hidden):
      name = f'hidden_{i}'
      if self.method == 'sp':
        x = nn.relu(nn.Dense(width, kernel_init=glorot, param_dtype=pd, name=name)(x))
      elif self.method in ('wn', 'wn_mbn'):
        use_bias = self.method == 'wn'
        dense = nn.Dense(width, use_bias=use_bias, kernel_init=glorot, param_dtype=pd, name=name)
        x = nn.WeightNorm(dense, param_dtype=pd, name=f'{name}_wn')(x)
        if self.method == 'wn_mbn':
          x = geoparam.MeanOnlyBatchNorm(param_dtype=pd, name=f'{name}_mbn')(
              x, use_running_average=not train)
        x = nn.relu(x)
      elif self.method == 'bn':
        x = nn.Dense(width, use_bias=False, kernel_init=glorot, param_dtype=pd, name=name)(x)
        x = nn.BatchNorm(momentum=0.99, epsilon=1e-3, param_dtype=pd, name=f'{name}_bn')(
            x, use_running_average=not train)
        x = nn.relu(x)
      else:
        x = geoparam.GmPDense(
            width, input_mean_norm=self.method == 'gmp_imn' and i > 0,
            glorot_scale=self.gmp_glorot_scale, param_dtype=pd, name=name)(
                x, use_running_average=not train)
    return nn.Dense(self.out, kernel_init=glorot, param_dtype=pd, name='out')(x)
