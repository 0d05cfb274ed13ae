"""Plain Flax models written the way users write them, for the whole-model transform tests.

`ResNet` follows the shape of flax/examples/imagenet/models.py (a `conv` and a
`norm` ModuleDef field, BasicBlock and Bottleneck blocks, the last BatchNorm of
each block starting at scale 0); `TransformerMLP` is a pre-norm transformer MLP
block with `nn.DenseGeneral` and GELU; `SmallCNN` a conv net with pooling.
Our own code, not copied.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any


class BasicBlock(nn.Module):
  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable = nn.relu
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), self.strides)(x)
    y = self.act(self.norm()(y))
    y = self.conv(self.filters, (3, 3))(y)
    y = self.norm(scale_init=nn.initializers.zeros)(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), self.strides, name='proj')(residual)
      residual = self.norm(name='proj_norm')(residual)
    return self.act(residual + y)


class Bottleneck(nn.Module):
  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable = nn.relu
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.act(self.norm()(self.conv(self.filters, (1, 1))(x)))
    y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
    y = self.norm(scale_init=nn.initializers.zeros)(self.conv(self.filters * 4, (1, 1))(y))
    if residual.shape != y.shape:
      residual = self.conv(self.filters * 4, (1, 1), self.strides, name='proj')(residual)
      residual = self.norm(name='proj_norm')(residual)
    return self.act(residual + y)


class ResNet(nn.Module):
  """A small ResNet: a BasicBlock stage, then a Bottleneck stage, like the imagenet example."""
  stage_sizes: Sequence[int] = (1, 1)
  num_filters: int = 8
  num_classes: int = 5
  dtype: Any = jnp.float32
  act: Callable = nn.relu
  conv: ModuleDef = nn.Conv

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(self.conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, dtype=self.dtype)
    x = conv(self.num_filters, (3, 3), padding=[(1, 1), (1, 1)], name='conv_init')(x)
    x = self.act(norm(name='bn_init')(x))
    blocks = (BasicBlock, Bottleneck)
    for i, n in enumerate(self.stage_sizes):
      for j in range(n):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = blocks[i % 2](self.num_filters * 2**i, conv=conv, norm=norm, act=self.act,
                          strides=strides)(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype, name='head')(x)


class TransformerMLP(nn.Module):
  """LayerNorm -> DenseGeneral up (GELU) -> DenseGeneral down, residual; tokens `(B, T, H, D)`."""
  heads: int = 2
  head_dim: int = 4
  hidden: int = 16

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    y = nn.LayerNorm(name='ln')(x)
    y = nn.DenseGeneral(self.hidden, axis=(-2, -1), name='up')(y)
    y = nn.gelu(y)
    y = nn.Dense(self.heads * self.head_dim, name='down')(y)
    return x + y.reshape(x.shape)


class SmallCNN(nn.Module):
  num_classes: int = 3

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    x = nn.relu(nn.Conv(6, (3, 3), padding='VALID', name='c1')(x))
    x = nn.max_pool(x, (2, 2), (2, 2))
    x = nn.tanh(nn.Conv(8, (3, 3), padding='CIRCULAR', feature_group_count=2, name='c2')(x))
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(self.num_classes, name='head')(x)
