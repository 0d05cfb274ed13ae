"""A layer run with a method's kernel and bias, IMN included: the part linen and NNX share.

The frameworks differ only in how they run the layer and keep IMN's running
mean; each hands `forward` a `LayerOps` (how to run its layer) and a function
that returns the mean of the layer's input. Everything else, the method's map,
IMN's choice between subtracting and folding, its exact border correction for
zero-padded convs and the dtype policy, is here, once.

IMN (paper 002 eq. 16) never needs a pass over the activations to be exact:
`layer(x - mu) = layer(x) - layer(mu * 1)`, for a dense layer `kernel^T mu`
folded into the bias, for a conv the conv of one constant image
(`geoparam.conv.split`: a bias plus a correction at the output positions
whose windows hold padded zeros). Where the input is smaller than the kernel
it is cheaper to subtract the mean from the input (`imn_subtracts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from geoparam import conv
from geoparam.methods.base import Method

__all__ = ['LayerOps', 'check_examples', 'forward', 'imn_subtracts', 'flatten_contracted',
           'subtract_mean', 'params_dtype']


class LayerOps(NamedTuple):
  """How to run one layer, as a framework sees it.

  Attributes:
    run: `run(kernel, bias, inputs) -> outputs`: the layer with this kernel and
      bias (None: no bias) in the layer's own layout, its own semantics (padding,
      groups, dtypes, precision).
    contract_axes: the input axes IMN's mean is taken per position of
      (`geoparam.kinds.Kind.imn_axes`); None without IMN.
    precision: the layer's `precision`, for IMN's fold.
    tap_mask: convs only, `tap_mask(spatial_in) -> (*spatial_out, taps)`
      (`geoparam.conv.tap_mask`): what each kernel tap sees of an image of ones.
    kernel_mask: a conv's `mask` over its kernel, or None.
    layout: the layer's `geoparam.kinds.Layout`; `forward` hands `run` the
      method's kernel and bias in the layer's layout. None: the method's.
  """
  run: Callable[[jax.Array, jax.Array | None, jax.Array], jax.Array]
  contract_axes: tuple[int, ...] | None
  precision: Any = None
  tap_mask: Callable[[tuple[int, ...]], np.ndarray] | None = None
  kernel_mask: Any = None
  layout: Any = None

  @classmethod
  def of(cls, layer, kind, run, tap_mask, layout, ndim: int, imn: bool) -> LayerOps:
    """The `LayerOps` of `layer` (of `geoparam.kinds` kind `kind`) for inputs of rank `ndim`
    (IMN's axes when `imn`): the shell gives how to run it and, for a conv, its `tap_mask`; the
    rest is read off the layer's fields."""
    return cls(run, kind.imn_axes(layer, ndim) if imn else None, getattr(layer, 'precision', None),
               tap_mask if kind.taps else None,
               getattr(layer, 'mask', None) if kind.taps else None, layout)


def imn_subtracts(inputs_shape: Sequence[int], kernel_shape: Sequence[int]) -> bool:
  """Whether IMN is cheaper as `x - mean` than folded into the bias, for a layer's shapes.

  Both are exact. Subtracting is one elementwise pass over the inputs (fused with the
  reduction that takes their mean); folding is work in proportion to the kernel
  (`kernel^T mean` forward, a rank-1 kernel gradient backward). So small activations and
  large kernels (ResNet-50's late stages at small batches or images) subtract, the papers'
  batch-256 activations fold.

    >>> imn_subtracts((16, 2, 2, 512), (3, 3, 512, 512))  # 32k activations, 2.4M kernel
    True
    >>> imn_subtracts((256, 56, 56, 64), (3, 3, 64, 64))
    False
  """
  return math.prod(inputs_shape) < math.prod(kernel_shape)


def flatten_contracted(x, axes: tuple[int, ...]):
  """`x` with the contracted `axes` moved last (in their order) and flattened into one:
  `(..., prod(axes))`. A jax or a numpy array (the float64 conversion uses the same layout).

    >>> import numpy as np
    >>> flatten_contracted(np.zeros((2, 3, 4, 5)), (1, 3)).shape
    (2, 4, 15)
  """
  rest = tuple(i for i in range(x.ndim) if i not in axes)
  moved = x.transpose(rest + tuple(axes))
  return moved.reshape(moved.shape[:len(rest)] + (-1,))


def subtract_mean(x: jax.Array, mean: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  """`x` minus `mean` `(prod of x's shape over axes,)`, laid out as `flatten_contracted` does."""
  m = mean.astype(x.dtype).reshape((1,) * (x.ndim - len(axes)) + tuple(x.shape[a] for a in axes))
  return x - jnp.moveaxis(m, tuple(range(x.ndim - len(axes), x.ndim)), axes)


def params_dtype(params) -> Any:
  """The stored variables' dtype: what the layer's own params would be."""
  return jnp.result_type(*jax.tree.leaves(params))


def forward(method: Method, params, ops: LayerOps, inputs: jax.Array, kernel_shape,
            input_mean: Callable[[jax.Array], jax.Array] | None = None,
            dtype=None) -> jax.Array:
  """The layer's output with the kernel and bias of `method`'s `params` (IMN if the method has it).

  Args:
    method: the parameterization; `method.apply(params, kernel_shape)` gives `(kernel, bias)`.
    params: its stored variables.
    ops: how to run the layer.
    inputs: the layer's input.
    kernel_shape: the method's, `(*fan_in_axes, F)` (`kinds.Layout.method_shape`).
    input_mean: with IMN, `input_mean(flat) -> (n,)`: the mean to subtract from the
      inputs flattened by `flatten_contracted` (batch mean or running mean; the
      framework keeps the running statistics).

  The method's `after` (the paper form's activation and scale) follows the layer. The kernel
  and bias are cast to `dtype` (default: the params' dtype;
  `methods.base.layer_dtype` leaves out variables kept wider than `param_dtype`)
  after the map (which runs in float32 at least) and after IMN's fold.

  A dense layer run by hand, with WN and IMN (`x - mean` is centred, so it maps to the bias):

    >>> import jax.numpy as jnp
    >>> from geoparam import methods
    >>> wn = methods.with_imn(methods.get('wn', epsilon=0.0))
    >>> params = {'kernel': jnp.eye(2), 'scale': jnp.ones(2), 'bias': jnp.array([1.0, 2.0])}
    >>> ops = LayerOps(run=lambda k, b, x: x @ k + b, contract_axes=(1,))
    >>> x = jnp.array([[1.0, 0.0], [3.0, 4.0]])
    >>> forward(wn, params, ops, x, (2, 2), input_mean=lambda flat: flat.mean(0)).tolist()
    [[0.0, 0.0], [2.0, 4.0]]
  """
  kernel, bias = method.apply(params, kernel_shape)
  dtype = params_dtype(params) if dtype is None else dtype
  cast = lambda a: None if a is None else a.astype(dtype)
  run = lambda k, b, x: ops.run(*((k, b) if ops.layout is None else ops.layout.to_layer(k, b)), x)
  mean = None
  if method.imn is not None:
    axes = ops.contract_axes
    mean = input_mean(flatten_contracted(inputs, axes))
    if imn_subtracts(inputs.shape, kernel_shape):
      inputs, mean = subtract_mean(inputs, mean, axes), None
  if mean is not None and bias is None:
    bias = jnp.zeros(kernel_shape[-1], kernel.dtype)
  if mean is None:
    y = run(cast(kernel), cast(bias), inputs)
  elif ops.tap_mask is None:  # u^T (x - mu) + b = u^T x + (b - u^T mu)
    flat = jnp.dot(mean.astype(kernel.dtype), kernel.reshape(-1, kernel_shape[-1]),
                   precision=ops.precision)
    y = run(cast(kernel), cast(bias - flat), inputs)
  else:  # conv(x - mu) = conv(x) - conv(mu * 1): (F,) in the bias, minus a correction at the
    # output positions whose windows hold padded zeros (exact at the borders), then the bias.
    num_spatial = len(kernel_shape) - 2
    mask = ops.tap_mask(tuple(inputs.shape[-num_spatial - 1:-1]))
    kernel = cast(kernel)
    flat, positions, correction = conv.split(mask, kernel, mean, ops.precision, ops.kernel_mask)
    y = conv.subtract_at(run(kernel, None, inputs), positions, correction, num_spatial)
    y = y + cast(bias - flat).astype(y.dtype)
  return y if method.after is None else method.after(y, params)


def check_examples(method, inputs_shape, name: str) -> None:
  """Raises unless a training (or init) call of a method with IMN has one example at least."""
  if method.imn is not None and not math.prod(inputs_shape):
    raise ValueError(
        f'{name}: {method.name!r} has IMN, which subtracts the batch mean of the inputs in '
        f'training and init, but the inputs (shape {tuple(inputs_shape)}) hold no example: the '
        'mean of none is undefined (nn.BatchNorm gives NaN); pass a batch of at least one example.')
