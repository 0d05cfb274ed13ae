"""One linen wrapper over any method: `Reparam(layer, method)`, and `GmP`, `LCW`, `CWN`, `WN`.

A wrapper stores its method's variables (`geoparam.methods`) and hands the
wrapped layer (any layer kind of `geoparam.kinds`: `nn.Dense`, `nn.Conv`,
`nn.DenseGeneral`, `nn.Einsum`, `nn.ConvTranspose`, or one you register) the
`kernel` and `bias` they stand for; the layer then runs unchanged, so padding,
groups, dtypes and precision are Flax's by construction. A method's units are
the layer's outputs and their fan-in every other kernel axis: a DenseGeneral
with several output axes (`features=(heads, head_dim)`, attention's q/k/v) is
seen as the kernel `(*contracted, heads * head_dim)` (`kinds.Layout`), its
kernel and bias put back in the layer's layout before it runs.

=======  ==========================================  ====================================
method   stored (collection `params`)                the layer sees
=======  ==========================================  ====================================
gmp      `theta (fan_in-1, F)`, `lam (F,)`,          `kernel = scale * u(theta)`,
         `scale (F,)` (+ fixed `sign` at fan-in 1)   `bias = scale * lam`
lcw      `v (fan_in-1, F)`, `bias`                   `kernel = B v` (columns sum to 0)
cwn      `kernel`, `scale (F,)`, `bias`              `scale * c / |c|`, `c = kernel - mean`
wn       `kernel`, `scale (F,)`, `bias`              `scale * kernel / |kernel|`
=======  ==========================================  ====================================

GmP hands the scale to the layer, so with the model's activation after it the
unit computes `act(scale * (u^T x + lam))`: for relu and leaky relu with
`scale > 0` this equals the paper's `scale * relu(u^T x + lam)` (positive
homogeneity, identical gradients), and for ANY activation it is an exact
reparameterization of `(kernel, bias)`, so trained weights convert exactly.

A method with IMN (`gmp_imn`, or any `methods.with_imn(m)`) centres the layer's
input (`geoparam.methods.run.forward`); the running mean is in
`batch_stats/.../input_mean_norm/mean`.

The whole-model transform (`geoparam.linen.transform`) runs the same `call` with the
original layer as the holder, so the variables sit at the layer's own path.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
import math
from typing import Any

import flax
import flax.linen as nn
from flax.core import meta
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from geoparam import checks
from geoparam import conv
from geoparam import exact
from geoparam import kinds
from geoparam import methods
from geoparam.methods import run

__all__ = ['Reparam', 'GmP', 'LCW', 'CWN', 'WN', 'PaperForm', 'paper_form', 'call', 'add_bias',
           'layer_ops', 'run_layer', 'plain', 'tap_mask']

Initializer = Callable[..., jax.Array]

kinds.register(kinds.DENSE, nn.Dense)
kinds.register(kinds.CONV, nn.Conv)
kinds.register(kinds.GENERAL, nn.DenseGeneral)
kinds.register(kinds.EINSUM, nn.Einsum)
kinds.register(kinds.CONV_TRANSPOSE, nn.ConvTranspose)
kinds.register(kinds.Kind('ConvLocal', refused='it has one kernel per output position, not one '
                          'per unit'), nn.ConvLocal)


# ----------------------------------------------------------------------------- the layer

def _describe(holder: nn.Module, layer: nn.Module | None = None) -> str:
  """`'LCWDense at 'a/b''`, `'GmP(Conv) at ...'` (a wrapper) for error messages."""
  name = type(holder).__name__
  if layer is not None and layer is not holder and isinstance(holder, _Wrapper):
    name += f'({type(layer).__name__})'
  path = holder.path if holder.scope is not None else ()
  where = '/'.join(path) if path else (holder.name or '')
  return name + (f' at {where!r}' if where else '')


SHELL = kinds.Shell(nn.Module, 'a flax.linen layer', 'an NNX layer takes geoparam.nnx.Reparam')


def layout_of(layer, inputs_shape, name) -> kinds.Layout:
  """`kinds.layout_of` of a linen layer."""
  return kinds.layout_of(layer, inputs_shape, name, SHELL)


def plain(layer: nn.Module) -> nn.Module:
  """The registered Flax layer (unbound) with `layer`'s fields: the `nn.Dense` of an `LCWDense`."""
  base = next(c for c in type(layer).__mro__[1:] if c in kinds.REGISTRY)
  return base(**{f.name: getattr(layer, f.name) for f in dataclasses.fields(base)
                 if f.init and f.name not in ('parent', 'name')}, parent=None)


def run_layer(layer: nn.Module, kernel: jax.Array, bias: jax.Array | None, inputs):
  """Runs `layer` (its fields only) with the given `kernel` and optional `bias`."""
  kind = kinds.of(layer)
  params = {kind.kernel: kernel}
  if bias is not None:
    params[kind.bias] = bias
  fields = {'use_bias': bias is not None} if hasattr(layer, 'use_bias') else {}
  layer = layer.clone(parent=None, name=None, **fields)
  with conv.bypass():  # the transform's interceptor steps aside
    return layer.apply({'params': params}, inputs)


def _run_dense(layer: nn.Dense, kernel, bias, inputs):
  """`nn.Dense`'s own computation (its fields) without a nested `apply`: an eager call of a
  wrapped Dense costs about half as much (`benchmarks.eager`); the results are the same ops."""
  inputs, kernel, bias = layer.promote_dtype(inputs, kernel, bias, dtype=layer.dtype)
  if layer.dot_general_cls is not None:
    dot_general = layer.dot_general_cls()
  else:
    dot_general = layer.dot_general or lax.dot_general
  y = dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
                  precision=layer.precision)
  return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


def tap_mask(layer: nn.Conv, spatial_in) -> np.ndarray:
  """`geoparam.conv.tap_mask` of a linen conv (its probe: the conv with one output per tap)."""
  kernel_size = kinds.ints(layer.kernel_size)
  # kernel_init: flax checks a given param's shape against its initializer's.
  probe = layer.clone(parent=None, name=None, features=math.prod(kernel_size),
                      kernel_size=kernel_size, feature_group_count=1, use_bias=False, mask=None,
                      dtype=jnp.float32, param_dtype=jnp.float32,
                      precision=lax.Precision.HIGHEST, kernel_init=nn.initializers.zeros)
  return conv.tap_mask(layer, spatial_in, lambda kernel, ones: probe.apply(
      {'params': {'kernel': kernel}}, ones))


# ----------------------------------------------------------------------------- variables

def _box_of(value):
  """`value` if it is a partitioning box (nn.Partitioned or a subclass), else None."""
  return value if isinstance(value, nn.Partitioned) else None


def box_like(value, kernel_shape, box, stacked: int = 0):
  """`value` with the kernel's partitioning `box` (names in the method's layout; None: none).

  A kernel-shaped variable keeps the kernel's names; others put the kernel's last
  name (the features) on their last axis and leave the rest unsharded (theta's
  and v's fan-in axis is a sequential product); the `stacked` leading axes of a
  layer stacked by `nn.scan` keep their names. A value already boxed is kept.
  """
  if box is None or _box_of(value) is not None:
    return value
  shape = tuple(jnp.shape(value))
  names = tuple(box.names)
  if shape != tuple(kernel_shape):
    names = names[:stacked] + (None,) * (len(shape) - stacked - 1) + names[-1:]
  return dataclasses.replace(box, value=value, names=names)


def _boxed(init, kernel_shape, kernel_box):
  """`init` whose output is boxed like the kernel (`box_like` with `kernel_box()`)."""
  return lambda key, shape, dtype=jnp.float32: box_like(init(key, shape, dtype), kernel_shape,
                                                         kernel_box())


def _get_or_create(holder: nn.Module, name: str, param: methods.Param, dtype, make_init):
  """`holder.param(name, ...)`, but an existing param is read directly, its shape checked.

  Flax's `param` re-traces the initializer on every call to check the stored
  shape (tens of ms per eager call for the map's initializers); this checks the
  shape itself, with an error naming the module, and builds the initializer only
  when the param is created.
  """
  shape, given = tuple(param.shape), holder.has_variable('params', name)
  if given:
    value = meta.unbox(holder.get_variable('params', name))
  else:
    value = meta.unbox(holder.param(name, make_init(), shape, dtype))
  if jnp.shape(value) != shape:
    raise ValueError(
        f'{type(holder).__name__} {"/".join(holder.path) or holder.name or ""}: {name} must have '
        f'shape {shape} for these inputs, got {jnp.shape(value)} ' + (
            'in the given params (the fan_in or the features differ).' if given else
            'from its initializer.'))
  return value


def create_params(holder: nn.Module, method: methods.Method, kernel_shape, layer_init,
                  param_dtype, kernel_box: Callable[[], nn.Partitioned | None] = lambda: None):
  """`(params, dtype)`: the method's variables in `holder` (created on first use), unboxed, in
  creation order, and the dtype the layer computes its kernel in (`methods.base.layer_dtype`).

  `layer_init`: a `methods.Layer`; `kernel_box()`: the partitioning box of the
  layer's kernel, if any (called only while creating).
  """
  key = []

  def new_key():  # one key for a joint draw, made only while creating
    if not key:
      key.append(holder.make_rng('params'))
    return key[0]

  specs = method.params(tuple(kernel_shape), layer_init, new_key)
  params = {name: _get_or_create(holder, name, p, methods.base.stored_dtype(p, param_dtype),
                                 lambda p=p: _boxed(p.init, kernel_shape, kernel_box))
            for name, p in specs.items()}
  return params, methods.base.layer_dtype(params, specs)


def layer_ops(layer: nn.Module, layout: kinds.Layout, ndim: int, imn: bool) -> run.LayerOps:
  """`run.LayerOps` of a linen layer for inputs of rank `ndim` (IMN's axes when `imn`)."""
  # exactly nn.Dense (GmPDense's plain layer): a subclass may compute otherwise, so it runs itself
  run_it = _run_dense if type(layer) is nn.Dense else run_layer  # pylint: disable=unidiomatic-typecheck
  return run.LayerOps.of(layer, kinds.of(layer), lambda kernel, bias, x: run_it(
      layer, kernel, bias, x), lambda spatial: tap_mask(layer, spatial), layout, ndim, imn)


def _variables(holder: nn.Module, method: methods.Method, layer: nn.Module,
               layout: kinds.Layout, use_bias: bool, ops):
  """`create_params` with the layer's own initializers (a partitioning box they give relabelled
  to the method's layout; the kernel's boxes every variable, except where `ops` runs the
  layer)."""
  dtype = getattr(layer, 'param_dtype', jnp.float32)
  own = methods.Layer()  # a layer without initializer fields gets Flax's defaults

  def relabelled(init):  # the layer's own initializer, a box of its layout put in the method's
    def draw(key, shape, dtype=jnp.float32):
      value = init(key, shape, dtype)
      box = _box_of(value)
      return value if box is None else dataclasses.replace(box, names=layout.names(box.names))
    return draw

  kernel_init = relabelled(getattr(layer, 'kernel_init', own.kernel_init))

  @functools.cache
  def box():  # the kernel's partitioning metadata (traced once, only while creating)
    return None if ops is not None else _box_of(jax.eval_shape(
        lambda k: kernel_init(k, layout.method_shape, dtype), jax.random.key(0)))

  layer_init = methods.Layer(kernel_init, relabelled(getattr(layer, 'bias_init', own.bias_init)),
                             use_bias)
  return create_params(holder, method, layout.method_shape, layer_init, dtype, box)


def call(holder: nn.Module, method: methods.Method, layer: nn.Module, inputs,
         use_running_average: bool | None = None, imn_field: bool | None = None, *,
         ops: run.LayerOps | None = None):
  """`layer(inputs)` with `method`'s kernel and bias; variables (and IMN's mean) in `holder`.

  Call from a compact method of `holder` (the wrapper, or the original layer
  itself in the whole-model transform). `use_running_average` (merged with
  `imn_field`, the holder's field) switches IMN's running mean. `ops`: how to
  run the layer, when not `layer_ops(layer)` (a layer that computes itself, whose
  `layer` only describes the kernel: its kernel init's sharding is not carried).

  A layer with `use_bias=False` gets the method's bias term (GmP's `lam`) only
  when the variables already hold it: checkpoints made so, and the layers whose
  BatchNorm the whole-model transform drops (`add_bias`).
  """
  inputs = jnp.asarray(inputs)
  name = _describe(holder, layer)
  layout = layout_of(layer, inputs.shape, name)
  kernel_shape = layout.method_shape
  methods.base.check_fan_in(method, kernel_shape, name)
  bias_names = methods.base.bias_names(method, kernel_shape)  # the method's bias term, if held
  use_bias = kinds.of(layer).has_bias(layer) or bool(bias_names) and all(
      holder.has_variable('params', n) for n in bias_names)
  if method.imn is not None and ops is None:
    try:
      kinds.of(layer).imn_axes(layer, inputs.ndim)
    except ValueError as e:
      raise ValueError(f'{name}: {method.name!r} has IMN, but {e}') from None
  for flag in (use_running_average, imn_field):
    checks.flag('use_running_average', flag, name, optional=True)
  if method.imn is not None and not inputs.size:
    if not (imn_field if use_running_average is None else use_running_average) or (
        holder.is_initializing()):
      run.check_examples(method, inputs.shape, name)
    method = method._replace(imn=None)  # evaluation: the empty output, as the plain layer's
  input_mean = None
  if method.imn is not None:
    # imported here: geoparam.linen.layers imports this module (its layers are PaperForms)
    from geoparam.linen.layers import InputMeanNorm  # pylint: disable=g-import-not-at-top
    imn = InputMeanNorm(use_running_average=imn_field, momentum=method.imn.momentum,
                        axis_name=method.imn.axis_name, name='input_mean_norm', parent=holder)
    input_mean = lambda flat: imn.mean(flat, use_running_average)
  params, compute = _variables(holder, method, layer, layout, use_bias, ops)
  ops = ops or layer_ops(layer, layout, inputs.ndim, method.imn is not None)
  if holder.is_mutable_collection('intermediates'):  # capture_intermediates=True, or asked for
    _sow_weights(holder, method, params, layer, layout, compute)
  try:
    return run.forward(method, params, ops, inputs, kernel_shape, input_mean, compute)
  except flax.errors.ScopeCollectionNotFound as e:
    if method.imn is None:
      raise
    raise ValueError(
        f"{name}: {method.name!r} keeps IMN's running mean in the collection batch_stats "
        f'(input_mean_norm/mean), which this call cannot reach: pass the variables with their '
        "batch_stats, and give a layer inside nn.scan/nn.vmap variable_axes={'params': 0, "
        "'batch_stats': 0} (as for BatchNorm). Flax said: " + str(e).split(' (https')[0]) from None


def _sow_weights(holder: nn.Module, method: methods.Method, params, layer: nn.Module,
                 layout: kinds.Layout, dtype) -> None:
  """Sows the kernel and bias the layer runs with (`geoparam.exact.effective`, in `dtype`), in its
  own layout, as `intermediates` `kernel` and `bias` of `holder` (computed again from the params:
  no stored copy)."""
  kernel, bias = exact.effective(method, layer, params, layout)
  holder.sow('intermediates', 'kernel', kernel.astype(dtype))
  if bias is not None:
    holder.sow('intermediates', 'bias', bias.astype(dtype))


def add_bias(holder: nn.Module, method: methods.Method, layer: nn.Module, inputs, outputs):
  """`outputs + bias`: creates the method's bias term for a bias-free `layer` (in `holder`,
  from a compact method of it) and adds the bias it stands for to the layer's `outputs` on
  `inputs`. The whole-model transform gives one so to a layer whose BatchNorm it drops.
  """
  layout = layout_of(layer, jnp.shape(inputs), _describe(holder, layer))
  params, _ = _variables(holder, method, layer, layout, True, None)
  _, bias = method.apply(params, layout.method_shape)
  return outputs + bias.reshape(layout.units).astype(outputs.dtype)


# ----------------------------------------------------------------------------- wrapper modules

class _Wrapper(nn.Module):
  """A layer run with the kernel and bias of a method (`get_method`); fields in subclasses."""

  reparameterized = True  # a reparameterized layer (`geoparam.linen.variance` reads its method)

  def get_method(self) -> methods.Method:
    return self._FACTORY(**{o: getattr(self, o) for o in methods.options_of(self._FACTORY)})

  def __getattr__(self, name: str) -> Any:
    """The wrapped layer's fields read through the wrapper (`GmP(nn.Dense(8)).features`), as
    model code reads its layers'."""
    try:
      return super().__getattr__(name)
    except AttributeError:
      layer = self.__dict__.get('layer')
      if layer is None or name.startswith('_') or not hasattr(layer, name):
        raise
      return getattr(layer, name)

  @nn.compact
  def __call__(self, inputs, use_running_average: bool | None = None):
    """Applies the layer to `inputs` with its reparameterized kernel and bias.

    `use_running_average`: IMN's switch, as `nn.BatchNorm` (methods with IMN only).
    """
    kinds.kind_of(self.layer, f'{type(self).__name__} of a {type(self.layer).__name__}', SHELL)
    return call(self, self.get_method(), self.layer, inputs, use_running_average,
                self.use_running_average)


class Reparam(_Wrapper):
  """Any method (a registry name or a `geoparam.methods.Method`) around any Dense/Conv layer.

  Example usage::

    >>> import jax, jax.numpy as jnp, flax.linen as nn, geoparam
    >>> layer = geoparam.Reparam(nn.Dense(4), 'lcw')
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (4,), 'v': (2, 4)}

  `GmP`, `LCW`, `CWN` and `WN` are this wrapper under their own names, the options of their
  method (`geoparam.methods.WRAPPERS`) as fields:

    >>> g = geoparam.GmP(nn.Conv(8, (3, 3)), input_mean_norm=True, momentum=0.9)
    >>> v = g.init(jax.random.key(0), jnp.ones((1, 5, 5, 2)), use_running_average=False)
    >>> g.get_method().name, jax.tree.map(jnp.shape, v['params'])
    ('gmp_imn', {'lam': (8,), 'scale': (8,), 'theta': (17, 8)})

  Attributes:
    layer: the wrapped layer (only its fields are used; it creates no variables).
    method: a name in `geoparam.methods.REGISTRY` or a `Method`.
    use_running_average: IMN's switch, as `nn.BatchNorm` (methods with IMN).
  """

  layer: nn.Module
  method: str | methods.Method
  use_running_average: bool | None = None
  _FACTORY = staticmethod(methods.get)


def _class(name: str, bases: tuple, factory, doc: str, module: str = __name__, fields=None,
           **extra) -> type:
  """The linen class `name` (of `module`, docstring `doc`): `bases` with `fields` (annotations),
  then `factory`'s options (and `extra`) as fields, defaults kept, and the factory that builds the
  method from them (`_FACTORY`)."""
  options = {**methods.options_of(factory), **extra}
  return type(name, bases, {'__annotations__': {**(fields or {}), **dict.fromkeys(options, Any)},
                            **options, '__module__': module, '__qualname__': name, '__doc__': doc,
                            '_FACTORY': staticmethod(factory)})


def _wrapper(name: str, factory) -> type:
  """The wrapper class `name`: `Reparam` with `factory`'s method, its options as fields."""
  return _class(name, (_Wrapper,), factory, (
      f'`Reparam(layer, method)` with the method `{factory.__module__}.{factory.__name__}(...)` '
      f'builds from the fields: {", ".join(methods.options_of(factory)) or "none"}; and '
      '`use_running_average` (IMN\'s switch, as `nn.BatchNorm`). Any layer kind '
      f'(`geoparam.kinds`); variables at the wrapper\'s path.'), fields={'layer': nn.Module},
                use_running_average=None)


GmP, LCW, CWN, WN = (_wrapper(n, f) for n, f in methods.WRAPPERS.items())


class PaperForm(nn.Module):
  """Mixed in before a Flax layer class: that layer's fields and semantics, computing with the
  kernel and bias of the method `_FACTORY(**options)` builds from the fields (`paper_form`).

    >>> import jax, jax.numpy as jnp, flax.linen as nn, geoparam
    >>> wn = geoparam.methods.WRAPPERS['WN']
    >>> WNDense = geoparam.linen.wrappers.paper_form('WNDense', wn, nn.Dense)
    >>> params = WNDense(4, epsilon=0.0).init(jax.random.key(0), jnp.ones((1, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (4,), 'kernel': (3, 4), 'scale': (4,)}
  """

  reparameterized = True  # a reparameterized layer already: no whole-model transform's target
  get_method = _Wrapper.get_method

  @nn.compact
  def __call__(self, inputs, use_running_average: bool | None = None):
    """The layer's output on `inputs` with its reparameterized kernel and bias (then, for the
    paper's GmP, its activation and scale); `use_running_average`: IMN's switch."""
    method, layer, name = self.get_method(), plain(self), type(self).__name__
    for field in ('kernel_init', 'bias_init') if method.own_init else ():
      if getattr(self, field) is not getattr(type(layer), field):
        raise TypeError(f'{name}: {field} is not used (GmP draws its own parameters): set '
                        'theta_init, lam_init or scale_init, or wrap the plain layer with '
                        "geoparam.GmP(layer, initialization='layer') to convert its draw.")
    if method.after is not None and isinstance(getattr(self, 'kernel_size', ()), int):
      raise ValueError(f'{name}: kernel_size must be a tuple of positive ints, one per spatial '
                       f'dim, got {self.kernel_size!r} (one spatial dim, or a 3x3 meant?).')
    return call(self, method, layer, inputs, use_running_average,
                getattr(self, 'use_running_average', None))


def paper_form(name: str, factory, layer: type[nn.Module], module: str = __name__) -> type:
  """The linen class `name` (of `module`): `layer`'s fields and semantics with the method
  `factory` builds from its options, declared as further fields (and `use_running_average`
  where it has IMN's)."""
  extra = {'use_running_average': None} if 'input_mean_norm' in methods.options_of(factory) else {}
  return _class(name, (PaperForm, layer), factory, (
      f'`{layer.__module__.split(".")[0]}.{layer.__name__}` computing with the kernel and bias of '
      f'the method `{factory.__module__}.{factory.__name__}(...)` builds from the fields '
      f'{", ".join(methods.options_of(factory)) or "(none)"}, beside the layer\'s own.'), module,
                **extra)
