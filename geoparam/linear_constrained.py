"""LCW layers (paper 003 Sec. 3): Dense and Conv whose unit kernels sum to zero.

Each output unit's kernel (for a conv: its flattened `K_1 x ... x K_d x C_in`
kernel) is `w = B_m v` (`geoparam.lcw.project`), with the trainable parameter
`v` of shape `(fan_in - 1, features)`, fan-in first like a Flax kernel. The
layers are drop-in replacements for `nn.Dense` / `nn.Conv` (same fields, same
padding/stride/dilation/group semantics); `B_m` is never formed.

`kernel_init` draws a kernel of the usual shape (so fan-based initializers see
the real fans) and `v` is its coordinates `B_m^T w`: the initial kernel is that
draw minus its per-unit mean.
"""

from __future__ import annotations

import flax.linen as nn

from geoparam.linen import wrappers
from geoparam.methods.lcw import kernel_from_v
from geoparam.methods.lcw import v_from_kernel

__all__ = ['LCWDense', 'LCWConv', 'kernel_from_v', 'v_from_kernel']


class LCWDense(wrappers.PaperForm, nn.Dense):
  """A Dense layer with linearly constrained (zero-sum) weights: `nn.Dense`'s fields and semantics.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from geoparam.linear_constrained import LCWDense
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
    >>> from geoparam.linear_constrained import LCWConv
    >>> layer = LCWConv(features=8, kernel_size=(3, 3))
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 5, 5, 2)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (8,), 'v': (17, 8)}
  """

  _METHOD = 'lcw'
