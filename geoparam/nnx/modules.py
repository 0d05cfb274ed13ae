"""geoparam's layers as Flax NNX modules: one implementation, the linen one, run on NNX state.

Each module here holds its variables as NNX attributes (`nnx.Param`,
`nnx.BatchStat`) with the same names and shapes as the linen module of the same
name (`theta`, `lam`, `scale`, `input_mean_norm['mean']`, ...), and computes
with that linen module's pure `apply`: outputs and gradients equal the linen
layers' by construction, and every formula exists once.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import geoparam.nnx as gnnx
    >>> layer = gnnx.GmPLinear(3, 4, rngs=nnx.Rngs(0))
    >>> layer.theta.shape, layer.lam.shape
    ((2, 4), (4,))
    >>> layer(jnp.ones((2, 3))).shape
    (2, 4)

Train/eval: modules with a running mean (IMN, mean-only BN) have the attribute
`use_running_average` (default False, as `nnx.BatchNorm`), which
`model.train()` / `model.eval()` switch; a call argument overrides it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import math
import numbers
from typing import Any

import flax.linen as nn
from flax import nnx
from flax import traverse_util
from flax.core import meta
from flax.nnx import variablelib
import jax
import jax.numpy as jnp
import numpy as np

from geoparam import activations
from geoparam import baselines
from geoparam import gmp
from geoparam import linear_constrained
from geoparam import normalization
from geoparam import transform
from geoparam import wrappers

__all__ = ['LinenBacked', 'GmPLinear', 'GmPConv', 'LCWLinear', 'LCWConv', 'CWNLinear', 'CWNConv',
           'InputMeanNorm', 'MeanOnlyBatchNorm', 'PReLU', 'GmP', 'LCW', 'CWN', 'WN',
           'LAYER_TYPES', 'linen_twin']

_VARIABLE_TYPES = {'params': nnx.Param, 'batch_stats': nnx.BatchStat}

# The NNX layers the wrappers accept; each has a linen twin with the same kernel layout.
LAYER_TYPES = (nnx.Linear, nnx.Conv, nnx.LinearGeneral)


class _Names(nn.Partitioned):
  """Sharding names riding through a linen init; NNX (not linen) places the value on the mesh."""

  def unbox(self, apply_constraint: bool = True):
    del apply_constraint
    return self.value


def _linen_init(init: Callable | None) -> Callable | None:
  """An NNX-style initializer as a linen one: `nnx.with_partitioning` metadata -> nn.Partitioned."""
  if init is None:
    return None

  def linen_init(key, shape, dtype=jnp.float32):
    value = init(key, shape, dtype)
    if isinstance(value, variablelib.VariableMetadata):
      names = value.metadata.get('out_sharding') or value.metadata.get('sharding_names')
      return _Names(value.raw_value, names=tuple(names)) if names else value.raw_value
    return value

  return linen_init


def _linen_fields(fields: dict[str, Any]) -> dict[str, Any]:
  """Module fields with every initializer made linen-compatible and paddings hashable."""
  out = {}
  for key, value in fields.items():
    if key.endswith('_init') and callable(value):
      value = _linen_init(value)
    elif key == 'padding' and isinstance(value, list):
      value = tuple(tuple(p) if isinstance(p, list) else p for p in value)
    out[key] = value
  return out


def _variable(vtype, leaf):
  """A linen leaf (maybe an nn.Partitioned box) as an NNX variable carrying its sharding names."""
  if isinstance(leaf, nn.Partitioned):
    return vtype(leaf.value, out_sharding=tuple(leaf.names))
  return vtype(meta.unbox(leaf))


class LinenBacked(nnx.Module):
  """Base: a linen module (static attribute `linen_module`) run on variables held as NNX state.

  Subclasses call `_adopt(module, variables)` in `__init__` with the linen
  variables; `_run(*args)` applies the module and writes the running
  statistics back when `use_running_average` is False.
  """

  def _adopt(self, module: nn.Module, variables) -> None:
    self.linen_module = module
    nested, paths = {}, []
    for col, tree in variables.items():
      for path, leaf in traverse_util.flatten_dict(dict(tree)).items():
        paths.append((col,) + path)
        node = nested
        for key in path[:-1]:
          node = node.setdefault(key, {})
        node[path[-1]] = _variable(_VARIABLE_TYPES[col], leaf)
    for name, value in nested.items():
      setattr(self, name, nnx.data(value) if isinstance(value, dict) else value)
    self.variable_paths = tuple(paths)
    self.has_stats = any(p[0] == 'batch_stats' for p in paths)

  def _variable_at(self, path):
    node = getattr(self, path[0])
    for key in path[1:]:
      node = node[key]
    return node

  def linen_variables(self) -> dict[str, Any]:
    """The variables in the linen module's layout, `{collection: {name: array}}`."""
    flat = {p: self._variable_at(p[1:])[...] for p in self.variable_paths}
    return traverse_util.unflatten_dict(flat)

  def _run(self, *args, use_running_average: bool | None = None):
    if not self.has_stats:
      return _applier(self.linen_module, None)(self.linen_variables(), *args)
    if use_running_average is None:
      use_running_average = self.use_running_average
    if use_running_average is None:
      raise ValueError(f'{type(self).__name__}: use_running_average is None; set it, call '
                       'model.train()/model.eval(), or pass it to the call.')
    use_running_average = bool(use_running_average)
    out = _applier(self.linen_module, use_running_average)(self.linen_variables(), *args)
    if use_running_average:
      return out
    out, updates = out
    for path, value in traverse_util.flatten_dict(dict(updates['batch_stats'])).items():
      self._variable_at(path)[...] = value
    return out


@functools.lru_cache(maxsize=512)
def _applier(module: nn.Module, use_running_average: bool | None):
  """`module.apply` jitted once per (module, mode): eager NNX calls compile once per shape.

  Inside `nnx.jit`/`jax.jit` the inner jit is inlined; it only spares eager
  callers (notebooks, debugging) the linen bookkeeping on every call.
  """
  if use_running_average is None:
    return jax.jit(module.apply)
  mutable = False if use_running_average else ['batch_stats']
  return jax.jit(functools.partial(module.apply, use_running_average=use_running_average,
                                   mutable=mutable))


def _init_variables(module: nn.Module, rngs: nnx.Rngs | None, example, **kwargs):
  key = rngs.params() if rngs is not None else jax.random.key(0)
  return module.init({'params': key}, example, **kwargs)


def _check_in_features(name, in_features):
  if (isinstance(in_features, bool) or not isinstance(in_features, numbers.Integral)
      or in_features < 1):
    raise ValueError(f'{name} needs in_features >= 1 (an integer), got {in_features!r}.')


def _tuple(value, n, name):
  if value is None:
    return None
  if isinstance(value, numbers.Integral):
    return (int(value),) * n
  value = tuple(value)
  if len(value) != n:
    raise ValueError(f'{name} must have one entry per spatial dim ({n}), got {value!r}.')
  return value


def _example_conv_input(kernel_size, kernel_dilation, in_features):
  """A batch-1 input as large as the dilated window (valid for any padding), `in_features` deep."""
  kernel_size = tuple(kernel_size)
  dilation = _tuple(kernel_dilation, len(kernel_size), 'kernel_dilation') or (1,) * len(kernel_size)
  spatial = tuple((k - 1) * d + 1 for k, d in zip(kernel_size, dilation))
  return jnp.zeros((1,) + spatial + (in_features,))


# ----------------------------------------------------------------------------- paper-form layers

class _PaperDense(LinenBacked):
  _LINEN: type[nn.Module]

  def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs,
               use_running_average: bool | None = False, **fields):
    name = type(self).__name__
    _check_in_features(name, in_features)
    fields = _linen_fields(fields)
    module = self._LINEN(features=out_features, **fields)
    self.in_features, self.out_features = in_features, out_features
    self.use_running_average = use_running_average
    kwargs = {'use_running_average': True} if fields.get('input_mean_norm') else {}
    self._adopt(module, _init_variables(module, rngs, jnp.zeros((1, in_features)), **kwargs))

  def __call__(self, inputs, use_running_average: bool | None = None):
    """Applies the layer to `inputs (..., in_features)`; returns `(..., out_features)`."""
    return self._run(inputs, use_running_average=use_running_average)


class _PaperConv(LinenBacked):
  _LINEN: type[nn.Module]

  def __init__(self, in_features: int, out_features: int, kernel_size: int | Sequence[int],
               strides: int | Sequence[int] = 1, *, rngs: nnx.Rngs,
               use_running_average: bool | None = False, **fields):
    name = type(self).__name__
    _check_in_features(name, in_features)
    kernel_size = (kernel_size,) if isinstance(kernel_size, numbers.Integral) else tuple(
        kernel_size)
    fields = _linen_fields(fields)
    module = self._LINEN(features=out_features, kernel_size=kernel_size, strides=strides,
                         **fields)
    self.in_features, self.out_features, self.kernel_size = in_features, out_features, kernel_size
    self.use_running_average = use_running_average
    example = _example_conv_input(kernel_size, fields.get('kernel_dilation', 1), in_features)
    kwargs = {'use_running_average': True} if fields.get('input_mean_norm') else {}
    self._adopt(module, _init_variables(module, rngs, example, **kwargs))

  def __call__(self, inputs, use_running_average: bool | None = None):
    """Applies the conv to `inputs (*batch, *spatial, in_features)`."""
    return self._run(inputs, use_running_average=use_running_average)


class GmPLinear(_PaperDense):
  """`scale * act(u(theta)^T x + lam)`: `geoparam.GmPDense` as an NNX module.

  `GmPLinear(in_features, out_features, *, rngs, **fields)`; fields as
  `geoparam.GmPDense` (`activation`, `input_mean_norm`, `momentum`, `axis_name`,
  `dtype`, `param_dtype`, `precision`, `theta_init`, `lam_init`, `scale_init`,
  `glorot_scale`); initializers may carry `nnx.with_partitioning` metadata.
  State: `theta (in_features - 1, out_features)`, `lam`, `scale`
  (+ `sign` at in_features 1), and with IMN `input_mean_norm['mean']`.
  """

  _LINEN = gmp.GmPDense


class GmPConv(_PaperConv):
  """`geoparam.GmPConv` as an NNX module: `GmPConv(in, out, kernel_size, strides, *, rngs, ...)`.

  Fields as `geoparam.GmPConv` (`padding`, `input_dilation`, `kernel_dilation`,
  `feature_group_count`, `activation`, `input_mean_norm`, ...).
  """

  _LINEN = gmp.GmPConv


class LCWLinear(_PaperDense):
  """`geoparam.LCWDense` (kernel `B v`, columns sum to zero) as an NNX module; state `v`, `bias`."""

  _LINEN = linear_constrained.LCWDense


class LCWConv(_PaperConv):
  """`geoparam.LCWConv` as an NNX module; state `v (fan_in - 1, out)`, `bias`."""

  _LINEN = linear_constrained.LCWConv


class CWNLinear(_PaperDense):
  """`geoparam.CWNDense` (centred weight normalization) in NNX; `kernel`, `scale`, `bias`."""

  _LINEN = baselines.CWNDense


class CWNConv(_PaperConv):
  """`geoparam.CWNConv` as an NNX module; state `kernel`, `scale`, `bias`."""

  _LINEN = baselines.CWNConv


class _Features(LinenBacked):
  """A per-feature module of `num_features` (the last axis), like `nnx.BatchNorm`."""

  _LINEN: type[nn.Module]

  def __init__(self, num_features: int, *, rngs: nnx.Rngs | None = None,
               use_running_average: bool | None = False, **fields):
    _check_in_features(type(self).__name__, num_features)
    module = self._LINEN(**_linen_fields(fields))
    self.num_features = num_features
    self.use_running_average = use_running_average
    stats = 'use_running_average' in module.__dataclass_fields__
    kwargs = {'use_running_average': True} if stats else {}
    self._adopt(module, _init_variables(module, rngs, jnp.zeros((1, num_features)), **kwargs))

  def __call__(self, x, use_running_average: bool | None = None):
    """Applies the module to `x (..., num_features)`."""
    return self._run(x, use_running_average=use_running_average)


class InputMeanNorm(_Features):
  """IMN: `x - E[x]` per feature; running mean `mean (num_features,)` as `nnx.BatchStat`.

  `InputMeanNorm(num_features, *, momentum=0.99, axis_name=None, use_running_average=False)`.
  """

  _LINEN = normalization.InputMeanNorm


class MeanOnlyBatchNorm(_Features):
  """`x - E[x] + bias` per feature; `mean` (`nnx.BatchStat`) and `bias` (`nnx.Param`)."""

  _LINEN = normalization.MeanOnlyBatchNorm


class PReLU(_Features):
  """Parametric ReLU, `negative_slope (num_features,)` (or `()` with `channel_shared=True`)."""

  _LINEN = activations.PReLU

  def __call__(self, x):
    """Applies PReLU elementwise to `x (..., num_features)`."""
    return self._run(x)


# ----------------------------------------------------------------------------- wrappers

_LAYER_FIELDS = {
  nnx.Linear: ('in_features', 'out_features', 'use_bias', 'dtype', 'param_dtype', 'precision',
               'dot_general', 'promote_dtype', 'preferred_element_type'),
  nnx.Conv: ('in_features', 'out_features', 'kernel_size', 'strides', 'padding',
             'input_dilation', 'kernel_dilation', 'feature_group_count', 'use_bias', 'mask',
             'dtype', 'param_dtype', 'precision', 'conv_general_dilated', 'promote_dtype',
             'preferred_element_type'),
  nnx.LinearGeneral: ('in_features', 'out_features', 'axis', 'batch_axis', 'use_bias', 'dtype',
                      'param_dtype', 'precision', 'dot_general', 'dot_general_cls',
                      'promote_dtype', 'preferred_element_type'),
}


def _layer_type(layer):
  for cls in LAYER_TYPES:
    if type(layer) is cls or isinstance(layer, cls):
      return cls
  return None


def _hashable(value):
  if isinstance(value, list):
    return tuple(_hashable(v) for v in value)
  return value


def linen_twin(layer: nnx.Module, name: str | None = None) -> nn.Module:
  """The linen layer computing what the NNX `layer` computes (same kernel layout); no params.

    >>> from flax import nnx
    >>> import geoparam.nnx as gnnx
    >>> gnnx.linen_twin(nnx.Conv(3, 8, (3, 3), rngs=nnx.Rngs(0))).kernel_size
    (3, 3)
  """
  cls = _layer_type(layer)
  name = name or type(layer).__name__
  if cls is None:
    raise TypeError(
        f'{name} cannot be reparameterized: accepted layer types are '
        f'{", ".join("nnx." + t.__name__ for t in LAYER_TYPES)}.')
  if getattr(layer, 'preferred_element_type', None) is not None:
    raise ValueError(f'{name}: preferred_element_type is not supported (got '
                     f'{layer.preferred_element_type!r}); leave it None.')
  common = dict(use_bias=layer.use_bias, dtype=layer.dtype, param_dtype=layer.param_dtype,
                precision=layer.precision)
  if cls is nnx.Linear:
    return nn.Dense(layer.out_features, **common)
  if cls is nnx.Conv:
    if layer.mask is not None:
      raise ValueError(f'{name}: a masked nnx.Conv (mask=...) is not supported.')
    return nn.Conv(layer.out_features, tuple(layer.kernel_size), strides=_hashable(layer.strides),
                   padding=_hashable(layer.padding),
                   input_dilation=_hashable(layer.input_dilation),
                   kernel_dilation=_hashable(layer.kernel_dilation),
                   feature_group_count=layer.feature_group_count, **common)
  if layer.batch_axis:
    raise ValueError(f'{name}: only LinearGeneral without batch_axis can be reparameterized '
                     f'(got batch_axis={dict(layer.batch_axis)!r}).')
  return nn.DenseGeneral(tuple(layer.out_features), axis=tuple(layer.axis), **common)


def example_input(layer: nnx.Module) -> jax.Array:
  """A small zero input that `layer` accepts (batch 1; shapes of its kernel)."""
  cls = _layer_type(layer)
  if cls is nnx.Conv:
    return _example_conv_input(layer.kernel_size, layer.kernel_dilation, layer.in_features)
  if cls is nnx.LinearGeneral:
    axes = tuple(layer.axis)
    ndim = max([len(axes) + 1] + [a + 1 for a in axes if a >= 0] + [-a for a in axes if a < 0])
    shape = [1] * ndim
    for a, n in zip(axes, layer.in_features):
      shape[a] = n
    return jnp.zeros(shape)
  return jnp.zeros((1, layer.in_features))


def _constant_init(variable):
  """A linen initializer returning `variable`'s value (boxed with its sharding names)."""
  value = variable[...]
  names = variable.get_metadata().get('out_sharding')

  def init(key, shape, dtype=jnp.float32):
    del key
    if math.prod(shape) != value.size:  # DenseGeneral asks for its kernel flattened
      raise ValueError(f'expected a parameter of shape {tuple(value.shape)}, asked for {shape}.')
    out = jnp.asarray(value, dtype).reshape(shape)
    return _Names(out, names=tuple(names)) if names else out

  return init


class _Wrapper(LinenBacked):
  """A linen wrapper (`geoparam.wrappers.GmP`, ...) around an NNX layer's linen twin."""

  _LINEN: type[nn.Module]
  METHOD: str

  def __init__(self, layer: nnx.Module, *, rngs: nnx.Rngs | None = None,
               use_running_average: bool | None = False, **options):
    name = f'{type(self).__name__}({type(layer).__name__})'
    twin = linen_twin(layer, name)
    fields = {f for f in self._LINEN.__dataclass_fields__} - {'layer', 'parent', 'name'}
    unknown = sorted(set(options) - fields)
    if unknown:
      raise TypeError(f'{type(self).__name__} takes the options {sorted(fields)}; got unknown '
                      f'{unknown}.')
    if options.get('initialization', 'paper') == 'paper' and self._LINEN is wrappers.GmP:
      if rngs is None:
        raise ValueError(f"{name}: initialization='paper' draws the directions; pass "
                         "rngs=nnx.Rngs(...), or initialization='layer' to start from the "
                         "layer's weights.")
    inits = {'kernel_init': _constant_init(layer.kernel)}
    if layer.use_bias:
      inits['bias_init'] = _constant_init(layer.bias)
    module = self._LINEN(twin.clone(**inits), **options)
    imn = bool(options.get('input_mean_norm'))
    variables = _init_variables(module, rngs, example_input(layer),
                                **({'use_running_average': True} if imn else {}))
    self.layer_type = _layer_type(layer)
    self.layer_fields = tuple((f, _hashable(getattr(layer, f))) for f in _LAYER_FIELDS[
        self.layer_type] if hasattr(layer, f))
    self.layer_metadata = tuple(
        (n, tuple(sorted(_metadata(getattr(layer, n)).items()))) for n in ('kernel', 'bias')
        if getattr(layer, n, None) is not None)
    self.kernel_shape = tuple(layer.kernel.shape)
    self.use_running_average = use_running_average
    self._adopt(self._LINEN(twin, **options), variables)

  def __call__(self, inputs, use_running_average: bool | None = None):
    """Applies the layer to `inputs` with its reparameterized kernel and bias."""
    if self.has_stats:
      return self._run(inputs, use_running_average=use_running_average)
    return self._run(inputs)

  def plain_layer(self, *, rngs: nnx.Rngs | None = None, approximate_borders: bool = False,
                  carry_bias: bool = False):
    """`(layer, bias)`: a new plain NNX layer (the wrapped type) with this wrapper's function.

    `bias` (numpy float64) is the bias the function needs; for a layer with
    `use_bias=False` a nonzero one raises unless `carry_bias` (the caller puts it
    elsewhere, as `bake` does into a following BatchNorm).
    """
    module = self.linen_module
    stored = self.linen_variables()
    mean = None
    if 'batch_stats' in stored:
      mean = np.asarray(stored['batch_stats']['input_mean_norm']['mean'], np.float64)
    kernel, bias = transform.plain_layer(
        self.METHOD, module, module.layer, stored['params'], self.kernel_shape, mean,
        (type(self).__name__,), approximate_borders)
    fields = dict(self.layer_fields)
    metadata = {n: dict(m) for n, m in self.layer_metadata}
    for n, m in metadata.items():
      fields[f'{n}_metadata'] = {k: v for k, v in m.items() if k in ('out_sharding',)}
    plain = self.layer_type(**fields, rngs=rngs or nnx.Rngs(0))
    plain.kernel[...] = jnp.asarray(kernel, plain.kernel.dtype)
    if plain.use_bias:
      plain.bias[...] = jnp.asarray(bias, plain.bias.dtype)
    elif np.any(bias != 0) and not carry_bias:
      raise ValueError(f'{type(self).__name__}: the plain layer has use_bias=False but the '
                       'reparameterized one has a nonzero bias: no plain weights match.')
    return plain, bias


def _metadata(variable) -> dict[str, Any]:
  return {k: _hashable(v) for k, v in variable.get_metadata().items() if k == 'out_sharding' and v}


class GmP(_Wrapper):
  """Geometric parameterization of an `nnx.Linear`/`nnx.Conv`/`nnx.LinearGeneral` layer.

  Same semantics as the linen `geoparam.GmP`: the layer computes with
  `kernel = scale * u(theta)` and `bias = scale * lam`; follow it with the
  activation as usual. `initialization='layer'` starts from the layer's current
  weights, converted exactly; `'paper'` (default) draws directions with `rngs`.
  Options: `input_mean_norm`, `momentum`, `axis_name`, `initialization`,
  `theta_init`, `lam_init`, `scale_init`. The wrapped layer's kernel sharding
  (`out_sharding`) carries to `theta` `(None, features_axis)`, `lam`, `scale`.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import geoparam.nnx as gnnx
    >>> dense = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    >>> g = gnnx.GmP(dense, initialization='layer')
    >>> bool(jnp.allclose(g(jnp.ones((2, 3))), dense(jnp.ones((2, 3))), atol=1e-6))
    True
  """

  _LINEN = wrappers.GmP
  METHOD = 'gmp'

  def __init__(self, layer, *, rngs=None, use_running_average=False, **options):
    super().__init__(layer, rngs=rngs, use_running_average=use_running_average, **options)
    self.METHOD = 'gmp_imn' if options.get('input_mean_norm') else 'gmp'


class LCW(_Wrapper):
  """Linearly constrained weights (kernel `B v`) of an NNX layer; `v` from its current kernel."""

  _LINEN = wrappers.LCW
  METHOD = 'lcw'


class CWN(_Wrapper):
  """Centred weight normalization of an NNX layer (state `kernel`, `scale`, `bias`)."""

  _LINEN = wrappers.CWN
  METHOD = 'cwn'


class WN(_Wrapper):
  """Weight normalization of an NNX layer (state `kernel`, `scale`, `bias`)."""

  _LINEN = wrappers.WN
  METHOD = 'wn'

