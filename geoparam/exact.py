"""Exact conversion of one trained layer to a method's variables and back (float64 inside).

Framework-neutral: both whole-model transforms (linen and NNX) call these with
the layer (its fields), its kind (`geoparam.kinds`) and its weights. A
BatchNorm after the layer folds into it (`bn_affine`); IMN's running mean starts
at the batch mean of the layer's input, absorbed into the bias, where that is
exact (`Kind.padding_free`); layers stacked by lifted transforms (`nn.scan`,
`nnx.vmap`) carry their stacked axes in front and convert one by one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from geoparam import conv
from geoparam import kinds
from geoparam import methods
from geoparam.methods import run
from geoparam.selection import name as _name

__all__ = ['bias_free_error', 'kernel_of', 'bn_affine', 'fed_layer', 'identity_batchnorm',
           'stack_of', 'layout_of', 'imn_width', 'convert_layer', 'plain_layer', 'effective',
           'convert_weights']


def layout_of(layer, inputs_shape, path=()) -> kinds.Layout:
  """`kinds.layout_of`, its errors naming the layer at `path`."""
  return kinds.layout_of(layer, inputs_shape, f'{type(layer).__name__} at {_name(path)}')


def kernel_of(kind: kinds.Kind, variables, path=()):
  """`variables[kind.kernel]`: a layer's kernel from its variables (a dict by name); a kind that
  names a variable the layer does not hold raises a ValueError saying what it holds.

    >>> kernel_of(kinds.DENSE, {'kernel': 1, 'bias': 0})
    1
    >>> kernel_of(kinds.DENSE, {'w': 1}, ('proj',))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: layer proj: its kind 'Dense' names the kernel variable 'kernel', but the layer holds ['w']: ...
  """
  if kind.kernel not in variables:
    raise ValueError(
        f'layer {_name(path)}: its kind {kind.name!r} names the kernel variable {kind.kernel!r}, '
        f'but the layer holds {sorted(variables)}: give the Kind the name the layer stores its '
        "kernel under (geoparam.kinds.Kind(..., kernel='...')).")
  return variables[kind.kernel]


def bn_affine(mean, var, epsilon: float, scale=None, bias=None):
  """`(s, t)` float64 with `BatchNorm(z) = s * z + t` in evaluation mode, `(features,)` each.

  `mean`, `var`: the running statistics; `scale`, `bias`: the affine params (None
  when the norm has none).
  """
  if any(_traced(a) for a in (mean, var, scale, bias)):
    xp, f = jnp, jnp.asarray  # under nnx.jit: in the statistics' dtype
  else:
    xp, f = np, lambda a: np.asarray(a, np.float64)
  s = 1.0 / xp.sqrt(f(var) + epsilon)
  if scale is not None:
    s = s * f(scale)
  t = -f(mean) * s
  if bias is not None:
    t = t + f(bias)
  return s, t


def identity_batchnorm(shape, epsilon: float, use_scale: bool, use_bias: bool, stats_dtype,
                       param_dtype, carried=0.0, producer=(), path=()):
  """`(batch_stats, params)` of the BatchNorm a dropped one bakes back to.

  The identity in evaluation mode: mean 0, var 1, scale `sqrt(1 + epsilon)`; its
  bias is `carried`, the bias of the bias-free layer at `producer` that feeds
  it, and a nonzero `carried` without a BatchNorm bias raises. `path`: the
  BatchNorm's. Arrays of `shape` (`(features,)`, or stacked).
  """
  stats = {'mean': jnp.zeros(shape, stats_dtype), 'var': jnp.ones(shape, stats_dtype)}
  params = {}
  if use_scale:
    params['scale'] = jnp.full(shape, math.sqrt(1.0 + epsilon), param_dtype)
  if use_bias:
    params['bias'] = jnp.broadcast_to(jnp.asarray(carried, param_dtype), shape)
  elif np.any(carried != 0):
    raise ValueError(
        f'bake: layer {_name(producer)} and the dropped BatchNorm {_name(path)} after it have '
        "use_bias=False in the plain model, but the reparameterized layer's bias (the "
        "BatchNorm's shift, folded in) is nonzero: no plain weights match. Keep that BatchNorm "
        '(drop_batchnorm=False, or exclude it) or give it a bias (use_bias=True).')
  return stats, params


def _traced(value) -> bool:
  return any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(value))


def fed_layer(bn_path, bn_input, outputs, layout_of, bn_axis, bn_features) -> tuple:
  """The path of the layer whose output is a dropped BatchNorm's input, checked to fold into it.

  `bn_input`: the BatchNorm's input (its `bn_axis` normalized, `bn_features` statistics);
  `outputs`: `{layer path: output}` of the selected layers; `layout_of(path)`: a layer's
  `kinds.Layout`. Raises where no selected layer feeds it, or where that layer's units are not
  one axis, the last of its output, of the BatchNorm's size.

    >>> import numpy as np
    >>> y = np.zeros((2, 4))  # the dense layer's output, the BatchNorm's input
    >>> fed_layer(('bn',), y, {('dense',): y}, lambda p: kinds.Layout((3, 4), (1,)), -1, (4,))
    ('dense',)
  """
  producer = [p for p, y in outputs.items() if y is bn_input]
  if not producer:
    raise ValueError(
        f'BatchNorm {_name(bn_path)} is dropped but its input is not the output of a '
        'reparameterized layer, so it cannot be folded (keep it with drop_batchnorm=False, or '
        'exclude it through `where`/`exclude`).')
  path, ndim = producer[0], jnp.ndim(bn_input)
  layout = layout_of(path)
  axes = tuple(a % ndim for a in kinds.ints(bn_axis))
  if len(layout.units) > 1:
    raise ValueError(
        f'BatchNorm {_name(bn_path)} is dropped but the layer {_name(path)} before it has '
        f'several output axes {layout.units}: its per-channel affine cannot be carried by that '
        "layer's bias both ways (keep it with drop_batchnorm=False, or exclude it).")
  if axes != (ndim - 1,) or tuple(bn_features) != layout.units:
    raise ValueError(
        f'BatchNorm {_name(bn_path)} normalizes axis {bn_axis} ({tuple(bn_features)} statistics) '
        f'of its input, not the {layout.units[0]} features (last axis) of the layer '
        f'{_name(path)} before it, so it cannot be folded into that layer: keep it with '
        'drop_batchnorm=False, or exclude it.')
  return path


def stack_of(kernel_shape, layout: kinds.Layout, path=()) -> tuple[int, ...]:
  """The leading axes a lifted transform (`nn.scan`, `nn.vmap`, `nnx.vmap`) stacked the layer's
  variables on: `()` for a layer of its own, `(L,)` for a layer of a scanned block.

  The stored kernel is the layer's own (`layout.kernel_shape`) with these axes in front
  (`variable_axes={'params': 0}`, as flax's examples scan and vmap); anything else raises.
  """
  own, kernel_shape = tuple(layout.kernel_shape), tuple(kernel_shape)
  extra = len(kernel_shape) - len(own)
  if extra == 0 and kernel_shape != own:
    raise ValueError(
        f'layer {_name(path)}: its stored kernel has shape {kernel_shape}, but its kind\'s layout '
        f'gives {own} for these inputs (features, fan-in or axes differ): a kind\'s layout must '
        'return the kernel shape the layer builds (geoparam.kinds.Layout).')
  if extra < 0 or kernel_shape[extra:] != own:
    raise ValueError(
        f'layer {_name(path)}: its stored kernel has shape {kernel_shape}, but the layer '
        f'computes with a {own} kernel: a layer stacked by nn.scan/nn.vmap/nnx.vmap must have its '
        "stacked axes in front (variable_axes={'params': 0}, in_axes=0); other axes are not "
        'supported.')
  return kernel_shape[:extra]


def imn_width(method, layer, inputs_shape, path=()) -> int | None:
  """The width of IMN's running mean for `layer`'s inputs of `inputs_shape` (the contracted input
  axes: a conv's input channels); None when `method` has no IMN. Raises, naming the layer, where
  IMN has no exact form for it."""
  if method.imn is None:
    return None
  try:
    axes = kinds.of(layer).imn_axes(layer, len(inputs_shape))
  except ValueError as e:
    raise ValueError(f'layer {_name(path)}: {method.name!r} has IMN, but {e}') from None
  return math.prod(inputs_shape[a] for a in axes)


def _flat_mean(kind, layer, x):
  """The IMN mean of a layer input as the wrappers compute it, float64 `(width,)`."""
  x = np.asarray(x, np.float64)
  flat = run.flatten_contracted(x, kind.imn_axes(layer, x.ndim))
  return flat.reshape(-1, flat.shape[-1]).mean(0)


def _mean_dot(kind, layer, mean, kernel, path=(), xp=np):
  """`w_f^T m` per unit `(F,)`: IMN's mean `m` against a kernel in the method's shape.

  A conv sees the channels of its group at every window position, through its
  `mask` where it has one; other kinds the flattened contracted axes. `xp`: `np`
  (float64 on the host), or `jnp` (traceable, at the highest matmul precision).
  """
  features = kernel.shape[-1]
  options = {} if xp is np else {'precision': jax.lax.Precision.HIGHEST}
  if kind.taps:
    mask = getattr(layer, 'mask', None)
    if xp is np and _traced(mask):
      raise ValueError(
          f"layer {_name(path)}: its mask is a traced array (made inside a traced "
          "function, e.g. the model's __call__), and IMN's fold needs its values: give the "
          'layer a mask made outside (a numpy array or a module attribute).')
    if mask is not None:  # the layer multiplies its kernel by it
      kernel = kernel * xp.asarray(mask, kernel.dtype).reshape(kernel.shape)
    return conv.tap_products(kernel, mean, xp, **options).sum(0)
  return xp.dot(mean, kernel.reshape(-1, features), **options)


def _stacked(one, stack, path, *arrays):
  """`one(where, *slices)` for every index of the leading `stack` axes of `arrays` (pytrees;
  `where`: `path` naming that layer of the stack, `('blocks', 'up[2]')`), results stacked."""
  pieces = [one(path[:-1] + (f'{path[-1]}[{",".join(map(str, i))}]',) if stack else path,
                *jax.tree.map(lambda a: a[i], arrays)) for i in np.ndindex(stack)]
  if not stack:
    return pieces[0]
  return jax.tree.map(lambda *xs: np.stack(xs).reshape(stack + np.shape(xs[0])), *pieces)


def convert_layer(method, layer, kernel, bias, inputs, path=(), fold=None,
                  stack: tuple[int, ...] = ()):
  """One trained layer's `(kernel, bias)` as `method`'s variables, exactly (float64 inside).

  Args:
    method: a `geoparam.methods.Method` (or a registry name).
    layer: the layer (its fields; linen or NNX), `kernel` and `bias` (None: no bias) its params
      in its own layout.
    inputs: the layer's input on an example batch (calibrates IMN; shapes only otherwise).
    path: for error messages.
    fold: optional `(s, t)` of a following BatchNorm folded in (`bn_affine`).
    stack: the leading axes of a layer stacked by a lifted transform: `kernel`, `bias`,
      `fold` and what comes back carry them in front, and each layer of the stack is
      converted on its own (errors name it, `up[2]`).

  Returns:
    `(stored, mean)`: the params `{name: array}` in the kernel's dtype, and IMN's
    running mean `(width,)` (None without IMN).

  Traced weights (under `jax.eval_shape`/`nnx.eval_shape`, `jax.jit`/`nnx.jit`) convert
  through `jax.pure_callback`: the same float64 conversion on the host, so the
  result is as exact as eagerly (a dropped BatchNorm's `fold` is then computed in
  its statistics' dtype), its errors raised when the compiled function runs;
  under `eval_shape` only the shapes and dtypes are made.
  """
  method = methods.get(method)
  layout = layout_of(layer, jnp.shape(inputs), path)
  if _traced((kernel, bias, fold)):
    return _on_host(method, layer, layout, kernel, bias, inputs, path, fold, stack)
  dtype = jnp.asarray(kernel).dtype
  return jax.tree.map(jnp.asarray, _stacked(
      lambda where, k, b, f: _convert_one(method, layer, layout, k, b, inputs, where, f, dtype),
      stack, path, kernel, bias, fold))


def _on_host(method, layer, layout, kernel, bias, inputs, path, fold, stack):
  """`convert_layer` of traced weights: its eager float64 self, run by `jax.pure_callback`."""
  dtype = jnp.result_type(kernel)
  use_bias = kinds.of(layer).has_bias(layer) or fold is not None
  specs = method.params(layout.method_shape, methods.Layer(use_bias=use_bias), lambda: None)
  stored = {k: jax.ShapeDtypeStruct(stack + tuple(p.shape), methods.base.stored_dtype(p, dtype))
            for k, p in specs.items()}
  width = imn_width(method, layer, jnp.shape(inputs), path)
  mean = None if width is None else jax.ShapeDtypeStruct(
      stack + (width,), jnp.promote_types(jnp.result_type(inputs), jnp.float32))

  def host(kernel, bias, inputs, fold):
    out, m = convert_layer(method, layer, kernel, bias, inputs, path, fold, stack)
    return ({k: np.asarray(v, stored[k].dtype) for k, v in out.items()},
            None if m is None else np.asarray(m, mean.dtype))

  return jax.pure_callback(host, (stored, mean), kernel, bias, inputs, fold)


def _convert_one(method, layer, layout, kernel, bias, inputs, path, fold, dtype):
  kind = kinds.of(layer)
  width = imn_width(method, layer, jnp.shape(inputs), path)
  imn = width is not None
  if imn and not np.size(inputs):
    raise ValueError(
        f'layer {_name(path)}: {method.name!r} has IMN, whose running mean starts at the mean '
        f'of the layer\'s input on the example batch, but that input is empty (shape '
        f'{tuple(jnp.shape(inputs))}): pass example inputs with at least one example.')
  kernel = layout.to_method(np.asarray(kernel, np.float64))  # units: the last axis
  bias = np.zeros(kernel.shape[-1]) if bias is None else np.asarray(bias, np.float64).reshape(-1)
  if fold is not None:  # per unit
    kernel, bias = kernel * fold[0], bias * fold[0] + fold[1]
  # A dropped BatchNorm's shift belongs to the layer before it, bias-free or not.
  use_bias = kind.has_bias(layer) or fold is not None
  # a layer inside a lifted transform (nn.scan, nn.vmap, nn.remat) has traced inputs: its
  # running mean starts at 0 (exact as well), not at the batch mean
  calibrate = (imn and use_bias and kind.padding_free(layer)
               and not isinstance(inputs, jax.core.Tracer))
  mean = _flat_mean(kind, layer, inputs) if calibrate else None
  if mean is not None and not np.all(np.isfinite(mean)):
    raise ValueError(
        f'layer {_name(path)}: the mean of its input on the example batch is not finite (entries '
        f'{np.flatnonzero(~np.isfinite(mean))[:8].tolist()} of {mean.size}): {method.name!r} '
        "starts IMN's running mean there; pass example inputs without NaN or inf (check the "
        'inputs and the layers before it).')
  if mean is not None:  # u^T (x - m) + b' == u^T x + b with b' = b + u^T m
    bias = bias + _mean_dot(kind, layer, mean, kernel, path)
  stored = _stored(method, kernel, bias, dtype, use_bias, lambda e: f'layer {_name(path)}: {e}')
  if not imn:
    return stored, None
  mean_dtype = jnp.promote_types(jnp.result_type(inputs), jnp.float32)
  return stored, jnp.asarray(np.zeros(width) if mean is None else mean, mean_dtype)


def _stored(method, kernel, bias, dtype, use_bias: bool, message) -> dict[str, jax.Array]:
  """`method.convert(kernel, bias, dtype, use_bias)`, each variable in its stored dtype; its
  ValueError `e` raised again as `message(e)` (naming the layer)."""
  try:
    stored = method.convert(kernel, bias, dtype, use_bias)
  except ValueError as e:
    raise ValueError(message(e)) from None
  specs = method.params(kernel.shape, methods.Layer(use_bias=use_bias), lambda: None)
  return {k: jnp.asarray(v, methods.base.stored_dtype(specs[k], dtype) if k in specs else dtype)
          for k, v in stored.items()}


def bias_free_error(method, path) -> ValueError:
  """The error of a layer with `use_bias=False` whose reparameterized form needs a bias."""
  why = ('its reparameterized form has a nonzero bias' if method.imn is None else
         f"IMN's running mean of its input moved from 0 in training, and {method.name!r} "
         'subtracts it (u^T (x - m) = u^T x - u^T m), which needs a bias')
  return ValueError(
      f'bake: layer {_name(path)} has use_bias=False in the plain model (and no dropped '
      f'BatchNorm after it to carry a bias), but {why}: no plain weights match. Leave such '
      'layers plain (exclude=[...] or a where= that skips bias-free layers), or drop the '
      'BatchNorm after them (drop_batchnorm=True), which takes the bias.')


def plain_layer(method, layer, stored, layout: kinds.Layout, mean, path=(),
                approximate_borders=False, stack: tuple[int, ...] = ()):
  """`(kernel, bias)` numpy float64 of the plain layer from `method`'s stored variables.

  `layout`: the layer's (`kinds.Layout`); the kernel and bias come back in the
  layer's layout. `mean`: IMN's running mean (None without IMN); a zero-padded
  conv with a nonzero one raises unless `approximate_borders`. `stack`: as in
  `convert_layer` (`stored`, `mean` and the result carry these leading axes).
  """
  method = methods.get(method)
  return _stacked(lambda where, s, m: _plain_one(method, layer, s, layout, m, where,
                                                 approximate_borders), stack, path, stored, mean)


def _plain_one(method, layer, stored, layout, mean, path, approximate_borders):
  kind = kinds.of(layer)
  shape = layout.method_shape
  try:
    kernel, bias = method.bake(stored, shape)
  except ValueError as e:
    raise ValueError(f'layer {_name(path)}: {e}') from None
  if mean is not None and not np.all(np.isfinite(mean)):
    raise ValueError(f"layer {_name(path)}: IMN's running mean has entries that are not finite "
                     f'({np.flatnonzero(~np.isfinite(mean))[:8].tolist()} of {np.size(mean)}).')
  kernel = np.asarray(kernel, np.float64).reshape(shape)
  bias = np.zeros(shape[-1]) if bias is None else np.asarray(bias, np.float64)
  if mean is not None and np.any(mean != 0):
    if not kind.padding_free(layer) and not approximate_borders:
      raise ValueError(
          f'layer {_name(path)}: a conv that pads zeros with a nonzero IMN running mean has no '
          'exact plain form (conv(x - m) differs from conv(x) - w^T m at the borders); pass '
          'approximate_borders=True to fold the mean anyway.')
    bias = bias - _mean_dot(kind, layer, np.asarray(mean, np.float64), kernel, path)
  return layout.to_layer(kernel, bias)


def effective(method, layer, stored, layout: kinds.Layout, mean=None):
  """`(kernel, bias)` of the plain layer that `method`'s `stored` variables stand for, traceable.

  The jax twin of `plain_layer` for one layer (no stacked axes: vmap over them), read inside
  `jit` and `grad` (gradients reach the stored variables): the kernel in the layer's layout, the
  bias `units` (None when the method has none and there is no IMN). IMN's running `mean`
  (None without IMN) is folded into the bias as `bake` folds it (a zero-padded conv: the
  interior's fold, `approximate_borders=True`). In the map's dtype (float32 at least).
  """
  method = methods.get(method)
  shape = layout.method_shape
  kernel, bias = method.apply(stored, shape)
  if mean is not None:
    mean = jnp.asarray(mean).astype(kernel.dtype)
    fold = _mean_dot(kinds.of(layer), layer, mean, kernel, xp=jnp)
    bias = (jnp.zeros(shape[-1], kernel.dtype) if bias is None else bias) - fold
  return layout.to_layer(kernel, bias)


def convert_weights(method, layer, kernel, bias, mean, layout: kinds.Layout, use_bias: bool,
                    dtype, path=(), stack: tuple[int, ...] = ()):
  """`method`'s stored variables for the plain `(kernel, bias)` (the layer's layout, float64
  inside; bias None: zeros), with IMN's running `mean` kept (None without IMN).

  What an assignment to a reparameterized layer's kernel or bias converts: the stored bias
  takes `w^T mean` (IMN subtracts it again), so `effective` reads `(kernel, bias)` back.
  `use_bias`: whether the reparameterized layer has a bias term. Raises a ValueError naming
  the layer where no variables give these weights (the method's own limits, a nonzero bias
  or running mean without a bias term). `stack`: as in `convert_layer`.
  """
  method = methods.get(method)

  def one(where, k, b, m):
    k = layout.to_method(np.asarray(k, np.float64))
    b = np.zeros(k.shape[-1]) if b is None else np.asarray(b, np.float64).reshape(-1)
    if m is not None and np.any(np.asarray(m) != 0):
      if not use_bias:
        raise ValueError(
            f'layer {_name(where)}: {method.name!r} has IMN, whose running mean is nonzero, and '
            'the layer has no bias term to take w^T mean, so no variables give these weights '
            "(bake refuses it too). Set the running mean to 0 first (layer.input_mean_norm['mean']"
            "[...] = 0, which changes the function by w^T mean), or set the method's variables "
            'directly.')
      b = b + _mean_dot(kinds.of(layer), layer, np.asarray(m, np.float64), k, where)
    return _stored(method, k, b, dtype, use_bias, lambda e: (
        f'layer {_name(where)}: {method.name!r} cannot hold these weights: {e} Assign weights '
        'the method can represent, or bake the layer (geoparam.nnx.bake / geoparam.bake) and '
        'assign to the plain one.'))

  return _stacked(one, stack, path, kernel, bias, mean)
