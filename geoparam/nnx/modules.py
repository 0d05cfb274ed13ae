"""geoparam's layers as native Flax NNX modules, on the same methods as the linen ones.

Each module holds `nnx.Param`/`nnx.BatchStat` and calls the method's pure
functions (`geoparam.methods`) and the shared layer run
(`geoparam.methods.run.forward`, IMN included) directly; no linen module runs
inside. The wrapped NNX layer itself computes (its `__call__` on a view that
sees the method's kernel and bias), so padding, groups, dtypes and precision are
Flax's. Variable names and layouts are the linen modules' (`theta`, `lam`,
`scale`, `input_mean_norm['mean']`, ...).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import geoparam.nnx as gnnx
    >>> layer = gnnx.GmPLinear(3, 4, rngs=nnx.Rngs(0))
    >>> layer.theta.shape, layer.lam.shape
    ((2, 4), (4,))
    >>> layer(jnp.ones((2, 3))).shape
    (2, 4)
    >>> stacked = nnx.eval_shape(lambda: gnnx.Reparam(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), 'wn'))
    >>> stacked.kernel.shape, stacked.scale.shape
    ((3, 4), (4,))

Train/eval: modules with a running mean (IMN, mean-only BN) have the attribute
`use_running_average` (default False, as `nnx.BatchNorm`), which
`model.train()` / `model.eval()` switch; a call argument overrides it.
"""

from __future__ import annotations

from collections.abc import Mapping
import functools
import os
from typing import Any
import warnings

from flax import nnx
from flax.core import meta
import jax
import jax.numpy as jnp
import numpy as np

from geoparam import activations
from geoparam import checks
from geoparam import conv
from geoparam import exact
from geoparam import kinds
from geoparam import methods
from geoparam import normalization
from geoparam.methods import run
from geoparam.selection import name as _path_name

__all__ = ['Reparam', 'GmP', 'LCW', 'CWN', 'WN', 'GmPLinear', 'GmPConv', 'LCWLinear', 'LCWConv',
           'CWNLinear', 'CWNConv', 'InputMeanNorm', 'MeanOnlyBatchNorm', 'PReLU', 'layer_ops',
           'layout_of', 'converted', 'Weight']

SHELL = kinds.Shell(nnx.Module, 'an NNX layer', 'a linen layer takes geoparam.Reparam')
kinds.register(kinds.DENSE, nnx.Linear)
kinds.register(kinds.CONV, nnx.Conv)
kinds.register(kinds.GENERAL, nnx.LinearGeneral)
kinds.register(kinds.EINSUM, nnx.Einsum)
kinds.register(kinds.CONV_TRANSPOSE, nnx.ConvTranspose)


# ----------------------------------------------------------------------------- running the layer

class _View:
  """`layer`'s attributes, with some replaced (its kernel and bias): what its `__call__` reads."""

  def __init__(self, layer, **replaced):
    self.__dict__.update(replaced, _layer=layer)

  def __getattr__(self, name):
    return getattr(self._layer, name)


def _probe(layer, kernel, ones):
  """`conv.tap_mask`'s probe: the NNX conv with a one-hot kernel per tap, one input channel."""
  view = _View(layer, kernel=kernel, bias=None, use_bias=False, in_features=1,
               out_features=kernel.shape[-1], feature_group_count=1, mask=None,
               dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST,
               promote_dtype=nnx.nn.dtypes.promote_dtype, kernel_shape=kernel.shape)
  return _own_call(layer)(view, jnp.asarray(ones))


def _own_call(layer):
  """`type(layer).__call__`, without `nnx.tabulate`'s recording wrapper (which reads an id off
  each graph node it sees; the views this module runs are none)."""
  call = type(layer).__call__
  code = getattr(call, '__code__', None)
  if code is not None and code.co_filename.endswith(os.path.join('nnx', 'summary.py')):
    call = call.__wrapped__
  return call


def layer_ops(layer: nnx.Module, layout: kinds.Layout, ndim: int, imn: bool,
              out_sharding=None) -> run.LayerOps:
  """`run.LayerOps` of an NNX layer for inputs of rank `ndim` (IMN's axes when `imn`).

  The layer's own `__call__` runs on a view of it whose kernel and bias are the given ones
  (`out_sharding`: passed to it when given, as `nnx.MultiHeadAttention` does).
  """
  kind = kinds.of(layer)
  kwargs = {} if out_sharding is None else {'out_sharding': out_sharding}

  def run_layer(kernel, bias, x):  # as Params: a layer may read `self.kernel.value` too
    bias = None if bias is None else nnx.Param(bias)
    view = _View(layer, **{kind.kernel: nnx.Param(kernel), kind.bias: bias,
                           'use_bias': bias is not None})
    return _own_call(layer)(view, x, **kwargs)

  return run.LayerOps.of(layer, kind, run_layer, lambda spatial: conv.tap_mask(
      layer, spatial, functools.partial(_probe, layer)), layout, ndim, imn)


def layout_of(layer, path=()) -> kinds.Layout:
  """The `kinds.Layout` of an NNX layer (from its fields); raises, naming `path`, for layers that
  cannot be reparameterized."""
  name = _path_name(path)
  kind = kinds.kind_of(layer, name, SHELL)
  if getattr(layer, 'preferred_element_type', None) is not None:
    raise ValueError(f'{name}: preferred_element_type is not supported (got '
                     f'{layer.preferred_element_type!r}); leave it None.')
  return exact.layout_of(layer, kind.example_shape(layer), path)


def _weights(layer, path=()):
  """`(kernel, bias)` variables of a plain NNX layer (bias None when it has none)."""
  kind = kinds.of(layer)
  held = {k: v for k, v in vars(layer).items() if isinstance(v, nnx.Variable)}
  bias = getattr(layer, kind.bias) if kind.has_bias(layer) else None
  return exact.kernel_of(kind, held, path), bias


# ----------------------------------------------------------------------------- variables

def _unbox(value):
  """`(array, sharding names or None)` of an initializer's output (NNX or linen metadata)."""
  if isinstance(value, nnx.VariableMetadata):
    names = value.metadata.get('out_sharding') or value.metadata.get('sharding_names')
    return value.raw_value, (tuple(names) if names else None)
  if isinstance(value, meta.Partitioned):
    return value.value, tuple(value.names)
  return value, None


def _sharded(names, shape, kernel_shape, kernel_names):
  """A variable's names: its own, else the kernel's features name on its last axis."""
  if names or not kernel_names:
    return names
  if tuple(shape) == tuple(kernel_shape):
    return tuple(kernel_names)
  return (None,) * (len(shape) - 1) + (kernel_names[-1],)


def _constant(value):
  """An initializer returning `value` (the layer's current weights)."""
  return lambda key, shape, dtype=jnp.float32: jnp.asarray(value, dtype).reshape(shape)


def _param(value, names):
  return nnx.Param(value, out_sharding=names) if names else nnx.Param(value)


def _linen_variables(module) -> dict[str, Any]:
  """The variables in the layout of the module's linen twin, `{'params': ..., 'batch_stats':
  ...}` (a collection only where the module has variables of it)."""
  out = {'params': nnx.state(module, nnx.Param).to_pure_dict(),
         'batch_stats': nnx.state(module, nnx.BatchStat).to_pure_dict()}
  return {k: v for k, v in out.items() if v}


def _mode(module, use_running_average):
  mode = module.use_running_average if use_running_average is None else use_running_average
  if mode is None:
    raise ValueError(f'{type(module).__name__}: use_running_average is None; set it, call '
                     'model.train()/model.eval(), or pass it to the call.')
  checks.flag('use_running_average', mode, type(module).__name__, optional=True)
  return bool(mode)


class _Held:
  """A layer without variables, held as a static attribute (outside the module graph)."""

  __slots__ = ('layer',)

  def __init__(self, layer):
    self.layer = layer


# ----------------------------------------------------------------------------- effective weights

_WEIGHTS = ('kernel', 'bias')


class Weight:
  """A reparameterized layer's effective kernel or bias: what `layer.kernel` / `layer.bias` read.

  Reads like an `nnx.Param` of the plain layer (`[...]`, `get_value()`, `.value`, `.shape`,
  `.dtype`, `get_metadata()` with the kernel's sharding names, array methods), computed from
  the method's variables at each read (`geoparam.exact.effective`: in `jit` and `grad` too, the
  gradients reach theta, scale, ...); not a variable of the model (`nnx.state` holds the
  method's). `.shape` and `.dtype` compute nothing. A write (`[...] = W`, `set_value(W)`,
  `.value = W`) converts the whole plain kernel (or bias) exactly into the method's variables
  (`geoparam.exact.convert_weights`), keeping the other.
  """

  __slots__ = ('_owner', '_which')

  def __init__(self, owner: 'Reparam', which: str):
    self._owner, self._which = owner, which

  def get_value(self) -> jax.Array:
    return self._owner.weights()[_WEIGHTS.index(self._which)]

  def set_value(self, value) -> None:
    self._owner._assign(self._which, value)  # pylint: disable=protected-access

  value = property(get_value, set_value)

  def __getitem__(self, index):
    return self.get_value() if index is Ellipsis else self.get_value()[index]

  def __setitem__(self, index, value):
    whole = index is Ellipsis or (isinstance(index, slice) and index == slice(None))
    self.set_value(value if whole else self.get_value().at[index].set(value))

  @property
  def shape(self) -> tuple[int, ...]:
    owner = self._owner
    own = tuple(owner.kernel_shape) if self._which == 'kernel' else owner.layout.units
    return owner._lead() + own  # pylint: disable=protected-access

  @property
  def dtype(self):
    return jnp.dtype(self._owner.kernel_dtype)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape))

  def __len__(self) -> int:
    return self.shape[0]

  def get_metadata(self, name=None, default=None):
    owner, names = self._owner, self._owner.kernel_names
    if names and self._which == 'bias':
      names = tuple(names[a] for a in owner.layout.unit_axes)
    metadata = {'out_sharding': names} if names and not owner.stack else {}
    return metadata if name is None else metadata.get(name, default)

  @property
  def sharding_names(self):
    return self.get_metadata('out_sharding')

  def __array__(self, dtype=None, copy=None):
    del copy
    return np.asarray(self.get_value(), dtype)

  def __jax_array__(self):
    return self.get_value()

  def __getattr__(self, name):  # `.T`, `.reshape(...)`, `.astype(...)`: the array's
    if name.startswith('_'):
      raise AttributeError(name)
    return getattr(self.get_value(), name)

  def __repr__(self):
    return (f'Weight({type(self._owner).__name__}.{self._which}: shape={self.shape}, '
            f'dtype={self.dtype}, computed from {list(self._owner.param_names)})')


def _operator(name):
  """`Weight`'s operator `name`: the value's, with a `Weight` operand read as its value."""
  def op(self, *other):  # one operand (binary operators) or none (unary)
    other = [o.get_value() if isinstance(o, Weight) else o for o in other]
    return getattr(self.get_value(), name)(*other)
  op.__name__ = name
  return op


for _name in ('add sub mul truediv floordiv pow matmul mod radd rsub rmul rtruediv rfloordiv rpow '
              'rmatmul rmod lt le gt ge eq ne neg abs').split():
  setattr(Weight, f'__{_name}__', _operator(f'__{_name}__'))
Weight.__hash__ = None


class _WeightAttribute:
  """The class attribute `kernel` / `bias` of `Reparam`: a `Weight` on read (None for a layer
  without a bias); an assigned array converts exactly. A method variable of the same name
  (WN's and CWN's `kernel`, the stored direction; LCW's `bias`) stays in the instance's
  `vars()`, so `nnx.state` and checkpoints keep its name; `params()` reads it."""

  def __init__(self, which: str):
    self.which = which

  def __get__(self, obj, cls=None):
    return self if obj is None else obj._weight(self.which)  # pylint: disable=protected-access

  def __set__(self, obj, value):
    if isinstance(value, (nnx.Variable, Weight)):
      raise TypeError(
          f'{type(obj).__name__}.{self.which}: a reparameterized layer\'s {self.which} is '
          "computed from the method's variables, so a variable cannot take its place (a tie "
          'between layers: reparameterize refuses one, naming it; tie the plain layers after '
          f'bake). Assign an array instead: layer.{self.which} = W (or [...] = W) converts it.')
    obj._assign(self.which, value)  # pylint: disable=protected-access

  def __delete__(self, obj):
    raise AttributeError(f'{type(obj).__name__}.{self.which} cannot be deleted.')


def _put(module, name, value):
  """Stores `value` under `name` in the module's `vars()` (past the `kernel`/`bias` class
  attributes), registered as data as `nnx.Module.__setattr__` registers it."""
  nodes = getattr(module, '_pytree__nodes', None)
  if getattr(module, '_pytree__is_pytree', False) and nodes is not None and name not in nodes:
    object.__setattr__(module, '_pytree__nodes', nodes.update({name: True}))
  vars(module)[name] = value


@functools.cache
def _typed(wrapper: type, layer_type: type) -> type:
  """The class `wrapper[layer_type]`: a subclass of both, made once per pair, so a
  reparameterized layer is still an instance of its layer's type (as `torch.nn.utils.parametrize`
  keeps a module's class). `Reparam[Linear]`, `GmP[Conv]`, ..."""
  name = f'{wrapper.__name__}[{layer_type.__name__}]'
  return type(name, (wrapper, layer_type), dict(
      __module__=wrapper.__module__, __qualname__=name, _wrapper=wrapper,
      __doc__=f'`{wrapper.__name__}` around an `{layer_type.__name__}`: an instance of both '
              '(made by `geoparam.nnx.Reparam`, one class per pair).'))


# ----------------------------------------------------------------------------- the wrapper

class Reparam(nnx.Module):
  """Any method around an NNX layer of a registered kind (`geoparam.kinds`): `nnx.Linear`,
  `nnx.Conv`, `nnx.LinearGeneral`, `nnx.Einsum`, `nnx.ConvTranspose`, or one you register.

  `Reparam(layer, method, *, rngs=None, use_running_average=False, **options)`:
  `method` a name in `geoparam.methods.REGISTRY` (with its `options`) or a
  `Method`. The method's variables start from the layer's current weights (its
  kernel and bias as the initializers the method reads) or, where the method
  draws (GmP's paper initialization), from `rngs`; `params` gives them instead
  (`{name: array}`). The layer's kernel sharding (`out_sharding`) carries to the
  stored variables. `plain_layer` (and `geoparam.nnx.bake`) give the plain layer back.

  The layer itself runs (its `__call__` on a view of it that sees the method's
  kernel and bias), so its semantics are Flax's. `GmP`, `LCW`, `CWN`, `WN` and
  the paper-form classes are this module under their own names.

  It is still its layer: an instance of a class made once per pair, `Reparam[Linear]`
  (`GmP[Conv]`, ...), a subclass of this one and of the layer's type, so `isinstance(g,
  nnx.Linear)` holds; the layer's fields read the same (`in_features`, `kernel_size`,
  `einsum_str`, ...); `kernel` and `bias` read the effective weights (a `Weight`, computed from
  the method's variables, in the layer's layout), and an array assigned to them converts exactly
  (`weights()` gives both arrays). A method variable named `kernel` or `bias` (WN's and CWN's
  direction, LCW's bias) keeps that name in `nnx.state`; `params()` reads it.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import geoparam.nnx as gnnx
    >>> dense = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    >>> g = gnnx.Reparam(dense, 'gmp', initialization='layer')
    >>> bool(jnp.allclose(g(jnp.ones((2, 3))), dense(jnp.ones((2, 3))), atol=1e-6))
    True
    >>> type(g).__name__, isinstance(g, nnx.Linear), g.in_features, g.kernel.shape
    ('Reparam[Linear]', True, 3, (3, 4))
    >>> bool(jnp.allclose(g.kernel[...], dense.kernel[...], atol=1e-6)), sorted(nnx.state(g, nnx.Param))
    (True, ['lam', 'scale', 'theta'])
  """

  reparameterized = True  # not a layer of its kind's (`geoparam.kinds.of`): no transform's target
  kernel = _WeightAttribute('kernel')
  bias = _WeightAttribute('bias')

  def __new__(cls, layer=None, *args, **kwargs):
    del args, kwargs
    if isinstance(layer, nnx.Module) and not issubclass(cls, _PaperForm) and kinds.of(
        layer) is not None:
      cls = _typed(getattr(cls, '_wrapper', cls), type(layer))  # (a typed class: its wrapper's)
    return object.__new__(cls)

  def __init__(self, layer: nnx.Module, method: str | methods.Method = 'gmp', *,
               rngs: nnx.Rngs | None = None, use_running_average: bool | None = False,
               params: dict[str, Any] | None = None, **options):
    name = f'{getattr(type(self), "_wrapper", type(self)).__name__}({type(layer).__name__})'
    method = methods.get(method, **options)
    layout = layout_of(layer, (name,))
    kind = kinds.of(layer)
    shape = layout.method_shape  # what the method sees
    methods.base.check_fan_in(method, shape, name)
    width = exact.imn_width(method, layer, kind.example_shape(layer), (name,))
    kernel, bias = _weights(layer, (name,))
    dtype = getattr(layer, 'param_dtype', None) or kernel.dtype
    kernel_names = kernel.get_metadata().get('out_sharding')
    # a bias-free layer gets the method's bias term only from given params that hold it (the
    # transform's layers whose BatchNorm is dropped), as in linen (`geoparam.linen.wrappers.call`)
    bias_names = methods.base.bias_names(method, shape)
    use_bias = kind.has_bias(layer) or (
        params is not None and bool(bias_names) and set(bias_names) <= set(params))
    # the method draws from the layer's current weights, in its own layout
    layer_init = methods.Layer(_constant(layout.to_method(kernel[...])),
                               _constant(bias[...].reshape(-1)) if bias is not None
                               else nnx.initializers.zeros, use_bias)

    def draw(keys):  # the method's initial variables (or the given ones), `{name: (value, names)}`
      specs = method.params(shape, layer_init, functools.cache(keys))  # a joint draw's one key
      if params is not None:
        return specs, {n: (jnp.asarray(params[n]), None) for n in specs if n in params}
      return specs, {n: _unbox(p.init(keys(), p.shape, methods.base.stored_dtype(p, dtype)))
                     for n, p in specs.items()}

    # without rngs, fixed keys: the draw must not depend on them (an initialization from weights)
    specs, drawn = draw(rngs.params if rngs is not None else nnx.Rngs(0).params)
    missing = [n for n in specs if n not in drawn]
    if missing:
      raise ValueError(f'{name}: params lacks {missing}: method {method.name!r} stores '
                       f'{list(specs)} for this layer (got {sorted(params)}); pass them all, '
                       'or leave params out to start from the layer\'s weights.')
    if rngs is None and params is None and not any(
        isinstance(v, jax.core.Tracer) for v, _ in drawn.values()):
      other = draw(nnx.Rngs(1).params)[1]  # a random draw would repeat in every layer of a shape
      if any(not np.array_equal(drawn[n][0], other[n][0]) for n in drawn):
        raise ValueError(
            f'{name}: method {method.name!r} draws its initial variables at random; pass '
            "rngs=nnx.Rngs(...) (or start from the layer's weights, e.g. GmP's "
            "initialization='layer').")
    stripped = nnx.clone(layer)  # its kernel a shape only (a kind's layout may read it)
    setattr(stripped, kind.kernel, nnx.Param(jax.ShapeDtypeStruct(kernel.shape, kernel.dtype)))
    setattr(stripped, kind.bias, None)
    self.held_layer = _Held(stripped)  # its fields only: no variables, not a graph node
    if not isinstance(getattr(type(self), 'method', None), property):  # a paper form's is
      self.method = method
    self.layout = layout
    self.kernel_shape = layout.kernel_shape  # the layer's own; the method's: layout.method_shape
    self.kernel_names = tuple(kernel_names) if kernel_names else None
    self.kernel_dtype = dtype
    self.layer_has_bias = kind.has_bias(layer)
    self.use_running_average = use_running_average
    self.stack = ()  # leading axes of a layer stacked by nnx.vmap (`converted`)
    self.param_names = tuple(specs)
    self.param_shapes = tuple(tuple(p.shape) for p in specs.values())  # unstacked
    self.wide_names = tuple(n for n, p in specs.items() if p.min_dtype is not None)
    if width is not None:
      self.input_mean_norm = nnx.data({'mean': nnx.BatchStat(
          jnp.zeros(width, jnp.promote_types(dtype, jnp.float32)))})
    method_names = layout.names(kernel_names)
    for pname, spec in specs.items():
      if (hasattr(type(self), pname) and pname not in _WEIGHTS) or pname in vars(
          self) or pname.startswith('_'):
        raise ValueError(f'{name}: method {method.name!r} stores a variable named {pname!r}, '
                         f'which the NNX module uses itself; rename it.')
      value, names = drawn[pname]
      if tuple(jnp.shape(value)) != tuple(spec.shape):
        raise ValueError(f'{name}: {pname} must have shape {tuple(spec.shape)}, got '
                         f'{jnp.shape(value)}.')
      _put(self, pname, _param(value, _sharded(names, spec.shape, shape, method_names)))

  # ------------------------------------------------------------------- the layer's attributes

  def __getattr__(self, name):
    """The wrapped layer's fields (`in_features`, `kernel_size`, `einsum_str`, ...)."""
    held = vars(self).get('held_layer') if not name.startswith('__') else None
    if held is not None and not name.startswith('_pytree__') and name not in _WEIGHTS:
      kind = kinds.of(held.layer)
      if name in (kind.kernel, kind.bias):  # a kind of your own names them otherwise
        return self._weight('kernel' if name == kind.kernel else 'bias')
      if hasattr(held.layer, name):
        return getattr(held.layer, name)
    raise AttributeError(f'{type(self).__name__!r} object has no attribute {name!r}')

  def __setattr__(self, name, value):
    if name in _WEIGHTS:  # past nnx's bookkeeping: an assignment converts (`_WeightAttribute`)
      Reparam.__dict__[name].__set__(self, value)
    else:
      super().__setattr__(name, value)

  # NNX's graph and pytree machinery sets attributes with object.__setattr__ / setattr: a method
  # variable named `kernel` or `bias` goes to `vars()`, past the class attributes.
  def _graph_node_set_key(self, key, value):
    current = vars(self).get(key)
    if key not in _WEIGHTS:
      super()._graph_node_set_key(key, value)
    elif isinstance(current, nnx.Variable) and isinstance(value, nnx.Variable):
      current.update_from_state(value)
    else:
      _put(self, key, value)

  def _graph_node_pop_key(self, key):
    if key not in _WEIGHTS:
      return super()._graph_node_pop_key(key)
    nodes = self._pytree__nodes
    object.__setattr__(self, '_pytree__nodes', type(nodes)(
        {k: v for k, v in nodes.items() if k != key}, copy=False))
    return vars(self).pop(key)

  def _graph_node_init(self, attributes):  # (the class has no other data descriptor)
    vars(self).update((str(name), value) for name, value in attributes)

  @classmethod
  def _pytree__unflatten(cls, static, node_attrs):
    node_keys, static_keys, static_attrs = static
    obj = object.__new__(cls)
    obj._graph_node_init([*zip(node_keys, node_attrs, strict=True),
                          *zip(static_keys, static_attrs, strict=True)])
    return obj

  # ------------------------------------------------------------------- effective weights

  def _lead(self) -> tuple[int, ...]:
    """The stacked axes in front of the variables as they are now (`nnx.scan` hands a slice)."""
    first = vars(self)[self.param_names[0]].shape
    return tuple(first[:len(first) - len(self.param_shapes[0])])

  def weights(self) -> tuple[jax.Array, jax.Array | None]:
    """`(kernel, bias)`: the effective weights, what `bake` gives the plain layer (IMN's running
    mean folded into the bias; for a zero-padded conv its interior fold), in the layer's layout
    and `param_dtype`, computed from the method's variables (traceable: `jit`, `grad`). `bias`
    is None for a layer without a bias (and no bias term). A layer stacked by `nnx.vmap` gives
    them stacked."""
    self._refuse_paper_form('plain weights')
    one = functools.partial(exact.effective, self.method, self.layer, layout=self.layout)
    for _ in self._lead():
      one = jax.vmap(one)
    kernel, bias = one(self.params(), mean=self._mean())
    bias = bias.astype(self.kernel_dtype) if self._has_bias_term() else None
    return kernel.astype(self.kernel_dtype), bias

  def _has_bias_term(self) -> bool:
    return self.layer_has_bias or bool(set(methods.base.bias_names(
        self.method, self.layout.method_shape)) & set(self.param_names))

  def _refuse_paper_form(self, what: str, error: type[Exception] = AttributeError) -> None:
    """The paper form has no plain `what` (kernel, bias, weights, layer): raises `error`."""
    if self.scale_outside:
      raise error(
          f'{type(self).__name__} has no {what}: the scale multiplies after the activation, so '
          'no plain kernel computes it; read or set its variables (params(), theta, ...).')

  def _weight(self, which):
    self._refuse_paper_form(which)
    return None if which == 'bias' and not self._has_bias_term() else Weight(self, which)

  def _assign(self, which, value):
    """Converts the plain `which` ('kernel' or 'bias') `value` (the other kept) into the method's
    variables, exactly (`geoparam.exact.convert_weights`); eager only."""
    name = type(self).__name__
    self._refuse_paper_form(f'plain {which} to assign', TypeError)
    params = self.params()
    if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((value, params))):
      raise ValueError(f'{name}: assigning the {which} converts it exactly on the host (float64), '
                       'so it runs outside jit/grad; assign outside the traced function, or set '
                       "the method's variables there.")
    if which == 'bias' and not self._has_bias_term():
      raise ValueError(f'{name}: the layer has no bias (use_bias=False), so there is none to '
                       'assign.')
    stack, mean = self._lead(), self._mean()
    new = list(exact.plain_layer(self.method, self.layer, params, self.layout, mean, (name,),
                                 approximate_borders=True, stack=stack))
    index = _WEIGHTS.index(which)
    value = np.asarray(value, np.float64)
    if value.shape != np.shape(new[index]):
      raise ValueError(f'{name}: the assigned {which} has shape {value.shape}, the layer\'s is '
                       f'{np.shape(new[index])}.')
    new[index] = value
    stored = exact.convert_weights(self.method, self.layer, *new, mean, self.layout,
                                   self._has_bias_term(), self.kernel_dtype, (name,), stack)
    for n in self.param_names:
      variable = vars(self)[n]
      variable.set_value(jnp.asarray(stored[n], variable.dtype))

  @property
  def layer(self) -> nnx.Module:
    """The wrapped layer's fields (its kernel and bias removed; the method stands for them)."""
    return self.held_layer.layer

  def params(self) -> dict[str, jax.Array]:
    """The method's stored variables, `{name: array}`."""
    return {n: vars(self)[n][...] for n in self.param_names}

  def _mean(self) -> jax.Array | None:
    """IMN's running mean (None without IMN)."""
    return self.input_mean_norm['mean'][...] if self.method.imn is not None else None

  def __call__(self, inputs, use_running_average: bool | None = None, out_sharding=None):
    """Applies the layer to `inputs` with its reparameterized kernel and bias (IMN first when the
    method has it; the paper form: then its activation and scale).

    `out_sharding`: the wrapped layer's own argument (`nnx.MultiHeadAttention` passes it).
    Traced (inside `nnx.jit`, `nnx.grad`, `nnx.scan`, ...) the call runs as is; an eager call
    runs it as one compiled function (`_eager`), not op by op (~15 dispatches, 3-5x an
    `nnx.Linear` call).
    """
    method = self.method
    mode = _mode(self, use_running_average) if method.imn is not None else None
    mean = self._mean()
    if mode is False:
      run.check_examples(method, jnp.shape(inputs), type(self).__name__)
    params = self.params()
    if mode and any(type(v).__name__ in ('JVPTracer', 'LinearizeTracer')  # under jax.grad
                    for v in jax.tree.leaves(params)):
      warnings.warn(
          f'{type(self).__name__}: {method.name!r} is differentiated in evaluation mode '
          "(use_running_average=True), so IMN's running mean stays frozen and the batch is not "
          'centred by its own mean. reparameterize gives the wrappers the mode of the model\'s '
          'modules, evaluation where none has one: call model.train() before training steps '
          '(model.eval() after), or pass use_running_average=False. Filter this warning '
          '(warnings.filterwarnings) to train with IMN frozen on purpose.', UserWarning,
          stacklevel=2)
    traced = any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((inputs, params, mean)))
    pure = self._pure if traced else functools.partial(_eager, self, self._signature())
    y, new_mean = pure(params, mean, jnp.asarray(inputs), mode, out_sharding)
    if mode is False:
      self.input_mean_norm['mean'][...] = new_mean
    return y

  def _signature(self):
    """The module's static attributes: an eager call recompiles when any of them changes."""
    return tuple((k, v) for k, v in vars(self).items()
                 if not isinstance(v, (nnx.Variable, dict, jax.Array)) and not k.startswith('_'))

  def _pure(self, params, mean, inputs, mode, out_sharding=None):
    """`(outputs, new running mean)` from the given variables (none read from `self`)."""
    name = type(self).__name__
    need = exact.layout_of(self.layer, inputs.shape, (name,)).kernel_shape
    if tuple(need) != self.kernel_shape:
      raise ValueError(f'{name}: the inputs {inputs.shape} need a kernel of shape {tuple(need)}, '
                       f'but the params are for {self.kernel_shape} (the fan_in or the features '
                       'differ).')
    imn = self.method.imn
    new_mean = [mean]

    def input_mean(flat):
      batch, new_mean[0] = normalization.mean_step(mean, flat, mode, imn.momentum, imn.axis_name)
      return batch

    plain = [v for n, v in params.items() if n not in self.wide_names] or list(params.values())
    ops = layer_ops(self.layer, self.layout, inputs.ndim, imn is not None, out_sharding)
    y = run.forward(self.method, params, ops, inputs, self.layout.method_shape,
                    input_mean if imn is not None else None, jnp.result_type(*plain))
    return y, new_mean[0]

  @property
  def scale_outside(self) -> bool:
    """The paper form (`GmPLinear`, `GmPConv`): the scale multiplies after the activation, so
    the module is not its layer with other weights; `bake` leaves it, `plain_layer` refuses."""
    return self.method.after is not None

  linen_variables = _linen_variables

  def plain_layer(self, *, approximate_borders: bool = False, carry_bias: bool = False,
                  path: tuple = ()):
    """`(layer, bias)`: a new plain NNX layer (the wrapped type) with this wrapper's function.

    `bias` (numpy float64) is the bias the function needs; for a layer with
    `use_bias=False` a nonzero one raises unless `carry_bias` (the caller puts it
    elsewhere, as `bake` does into a following BatchNorm). `path`: the layer's
    path in the model, for error messages (default: the wrapper's type).
    """
    path = tuple(path) or (type(self).__name__,)
    self._refuse_paper_form('plain layer', TypeError)
    kernel, bias = exact.plain_layer(self.method, self.layer, self.params(), self.layout,
                                     self._mean(), path, approximate_borders, self.stack)
    plain = nnx.clone(self.layer)
    kind = kinds.of(plain)
    setattr(plain, kind.kernel, _param(jnp.asarray(kernel, self.kernel_dtype),
                                       None if self.stack else self.kernel_names))
    if self.layer_has_bias:
      setattr(plain, kind.bias, nnx.Param(jnp.asarray(bias, self.kernel_dtype)))
    elif np.any(bias != 0) and not carry_bias:
      raise exact.bias_free_error(self.method, path)
    return plain, bias


@functools.partial(jax.jit, static_argnums=(0, 1, 5, 6))
def _eager(module, signature, params, mean, inputs, mode, out_sharding=None):
  """`module._pure` compiled once per module, static attributes (`signature`), mode and shapes.

  A module-level `jax.jit` of the pure core; the module and its static attributes are
  the static arguments, the variables the traced ones.
  """
  del signature
  return module._pure(params, mean, inputs, mode, out_sharding)


def converted(layer: nnx.Module, method: methods.Method, inputs=None, path=(), fold=None, *,
              use_running_average: bool | None = False, layout: kinds.Layout | None = None
              ) -> Reparam:
  """`Reparam` of `layer` holding its current weights converted exactly
  (`geoparam.exact.convert_layer`): what `geoparam.nnx.reparameterize` puts in its place.

  `inputs`: the layer's input on an example batch (calibrates IMN; None: a zero example);
  `fold`: a following BatchNorm's `(s, t)` folded in. A layer stacked on leading axes by
  `nnx.vmap` (run by `nnx.scan`) gets its variables stacked the same way (`module.stack`);
  `nnx.scan` hands each step one layer's slice. `layout`: the layer's, when already known
  (`layout_of`).
  """
  layout = layout_of(layer, path) if layout is None else layout
  kind = kinds.of(layer)
  kernel, bias = (None if v is None else v[...] for v in _weights(layer, path))
  stack = exact.stack_of(jnp.shape(kernel), layout, path)
  inputs = jnp.zeros(kind.example_shape(layer)) if inputs is None else inputs
  stored, mean = exact.convert_layer(method, layer, kernel, bias, inputs, path, fold, stack)
  first = (0,) * len(stack)
  if stack:  # one layer of the stack: what the module's fields and variables are made from
    layer = nnx.clone(layer)
    setattr(layer, kind.kernel, nnx.Param(kernel[first]))
    if bias is not None:
      setattr(layer, kind.bias, nnx.Param(bias[first]))
  module = Reparam(layer, method, use_running_average=use_running_average,
                   params={k: v[first] for k, v in stored.items()})
  if stack:
    for name in module.param_names:
      vars(module)[name].set_value(jnp.asarray(stored[name]))
  if mean is not None:
    stat = module.input_mean_norm['mean']
    stat.set_value(jnp.asarray(mean, stat.dtype))
  module.stack = tuple(stack)
  return module


def _wrapper(name: str, factory) -> type:
  """The NNX wrapper class `name`: `Reparam(layer, factory(**options))` (`methods.WRAPPERS`)."""

  def __init__(self, layer, *, rngs=None, use_running_average=False, **options):
    Reparam.__init__(self, layer, methods.build(factory, options, name), rngs=rngs,
                     use_running_average=use_running_average)

  doc = (f'`Reparam(layer, method, *, rngs=None, use_running_average=False)` with the method '
         f'`{factory.__module__}.{factory.__name__}(**options)` builds from the options: '
         f'{", ".join(methods.options_of(factory)) or "none"}. Same semantics as the linen '
         f'`geoparam.{name}`.')
  return type(name, (Reparam,), dict(__init__=__init__, __doc__=doc, __module__=__name__,
                                     __qualname__=name))


GmP, LCW, CWN, WN = (_wrapper(n, f) for n, f in methods.WRAPPERS.items())


class _PaperForm(Reparam):
  """The NNX layer `_LAYER(in_features, out_features, *args, **fields)` run with the method
  `_FACTORY` builds from its options, kept as attributes (`method` follows them)."""

  def __init__(self, in_features: int, out_features: int, *args, rngs: nnx.Rngs | None = None,
               use_running_average: bool | None = False, **fields):
    name, options = type(self).__name__, methods.options_of(self._FACTORY)
    checks.count('in_features', in_features, 1, name)
    checks.count('out_features', out_features, 1, name)
    if rngs is None:  # (a fixed key would start every layer of one shape from the same weights)
      raise TypeError(f'{name}: pass rngs=nnx.Rngs(...) (as {self._LAYER.__name__} needs): it '
                      'draws the initial weights.')
    for option in options:
      setattr(self, option, fields.pop(option, options[option]))
    own = self.method.own_init
    if own and {'kernel_init', 'bias_init'} & set(fields):
      raise TypeError(f'{name}: kernel_init and bias_init are not used (GmP draws its own '
                      'parameters): set theta_init, lam_init or scale_init.')
    # the method's own draw reads no kernel: the layer's is zeros, from a key of its own
    layer = self._LAYER(in_features, out_features, *args, rngs=nnx.Rngs(0) if own else rngs,
                        **({'kernel_init': nnx.initializers.zeros} if own else {}), **fields)
    super().__init__(layer, self.method, rngs=rngs, use_running_average=use_running_average)
    self.in_features, self.out_features = in_features, out_features

  @property
  def method(self) -> methods.Method:
    """The method its options (attributes) build now."""
    options = {o: getattr(self, o) for o in methods.options_of(self._FACTORY)}
    if isinstance(options.get('input_mean_norm'), Mapping):  # IMN's state: the switch is on
      options['input_mean_norm'] = True
    try:
      return _built(self._FACTORY, tuple(options.items()))
    except TypeError:  # an unhashable option (or a bad one: the factory raises again)
      return self._FACTORY(**options)


@functools.lru_cache(maxsize=256)
def _built(factory, options: tuple) -> methods.Method:
  """`factory(**dict(options))`, built once per distinct options: a paper form reads its
  method at every call (~90 us a build)."""
  return factory(**dict(options))


def _paper_form(name: str, factory, layer: type[nnx.Module]) -> type:
  """The NNX class `name`: `layer`'s arguments with the method `factory` builds from options."""
  doc = (f'`{name}(in_features, out_features, *args, rngs, use_running_average=False, '
         f'**fields)`: `nnx.{layer.__name__}`\'s arguments and semantics, computing with the method '
         f'`{factory.__module__}.{factory.__name__}(...)` builds from the options among the '
         f'fields ({", ".join(methods.options_of(factory))}), kept as attributes. Same semantics as '
         f'the linen `geoparam.{name.replace("Linear", "Dense")}`.')
  return type(name, (_PaperForm,), dict(_LAYER=layer, _FACTORY=staticmethod(factory), __doc__=doc,
                                        __module__=__name__, __qualname__=name))


# GmPLinear, GmPConv (`scale * act(u(theta)^T x + lam)`), LCWLinear, LCWConv, CWNLinear, CWNConv.
GmPLinear, GmPConv, LCWLinear, LCWConv, CWNLinear, CWNConv = (
    _paper_form(name + layer.__name__, factory, layer)
    for name, factory in methods.PAPER_FORMS.items() for layer in (nnx.Linear, nnx.Conv))


# ----------------------------------------------------------------------------- per-feature modules

class InputMeanNorm(nnx.Module):
  """IMN: `x - E[x]` per feature; running mean `mean (num_features,)` as `nnx.BatchStat`.

  `InputMeanNorm(num_features, *, momentum=0.99, axis_name=None, use_running_average=False)`.
  """

  def __init__(self, num_features: int, *, rngs: nnx.Rngs | None = None,
               use_running_average: bool | None = False, momentum: float = 0.99,
               axis_name: str | None = None):
    del rngs
    checks.count('num_features', num_features, 1, 'InputMeanNorm')
    checks.momentum(momentum)
    self.num_features, self.momentum, self.axis_name = num_features, momentum, axis_name
    self.use_running_average = use_running_average
    self.mean = nnx.BatchStat(jnp.zeros((num_features,), jnp.float32))

  linen_variables = _linen_variables

  def __call__(self, x, use_running_average: bool | None = None):
    """Centres `x (..., num_features)` over all but the last axis."""
    x = jnp.asarray(x)
    mode = _mode(self, use_running_average)
    mean, new = normalization.mean_step(self.mean[...], x, mode, self.momentum, self.axis_name)
    if not mode:
      self.mean[...] = new
    return x - mean.astype(x.dtype)


class MeanOnlyBatchNorm(InputMeanNorm):
  """`x - E[x] + bias` per feature; `mean` (`nnx.BatchStat`) and `bias` (`nnx.Param`)."""

  def __init__(self, num_features: int, *, rngs: nnx.Rngs | None = None,
               use_running_average: bool | None = False, momentum: float = 0.99,
               axis_name: str | None = None, use_bias: bool = True,
               bias_init=nnx.initializers.zeros, param_dtype=jnp.float32):
    super().__init__(num_features, use_running_average=use_running_average, momentum=momentum,
                     axis_name=axis_name)
    key = rngs.params() if rngs is not None else jax.random.key(0)
    self.bias = nnx.Param(bias_init(key, (num_features,), param_dtype)) if use_bias else None

  def __call__(self, x, use_running_average: bool | None = None):
    """Centres pre-activations `x (..., num_features)` and adds the bias."""
    y = super().__call__(x, use_running_average)
    return y if self.bias is None else y + self.bias[...].astype(y.dtype)


class PReLU(nnx.Module):
  """Parametric ReLU, `negative_slope (num_features,)` (or `()` with `channel_shared=True`)."""

  def __init__(self, num_features: int, *, rngs: nnx.Rngs | None = None,
               channel_shared: bool = False, negative_slope_init: float = 0.25, dtype=None,
               param_dtype=jnp.float32):
    del rngs
    checks.count('num_features', num_features, 1, 'PReLU')
    checks.real('negative_slope_init', negative_slope_init, owner='PReLU')
    checks.flag('channel_shared', channel_shared, 'PReLU')
    shape = () if channel_shared else (num_features,)
    self.num_features, self.dtype = num_features, dtype
    self.negative_slope = nnx.Param(jnp.full(shape, negative_slope_init, param_dtype))

  linen_variables = _linen_variables

  def __call__(self, x):
    """Applies PReLU elementwise to `x (..., num_features)`."""
    x, slope = nnx.nn.dtypes.promote_dtype((jnp.asarray(x), self.negative_slope[...]),
                                           dtype=self.dtype)
    return activations.prelu(x, slope)
