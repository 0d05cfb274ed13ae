"""Reparameterize any linen model without editing its source; carry trained weights both ways.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, geoparam
    >>> class MLP(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     x = nn.relu(nn.Dense(8, name='hidden')(x))
    ...     return nn.Dense(2, name='head')(x)
    >>> model = MLP()
    >>> x = jnp.ones((4, 3))
    >>> sp = model.init(jax.random.key(0), x)
    >>> gmp = geoparam.reparameterize(model, 'gmp', exclude=['head'])
    >>> converted = geoparam.to_reparameterized(gmp, sp, x)
    >>> jax.tree.map(jnp.shape, converted['params'])['hidden']
    {'lam': (8,), 'scale': (8,), 'theta': (2, 8)}
    >>> bool(jnp.allclose(gmp.apply(converted, x), model.apply(sp, x), atol=1e-5))
    True
    >>> baked = geoparam.bake(gmp, converted, x)
    >>> bool(jnp.allclose(model.apply(baked, x), model.apply(sp, x), atol=1e-5))
    True

`reparameterize(model, method)` runs `model` with every selected `nn.Dense`,
`nn.Conv` and `nn.DenseGeneral` call (several output axes too: attention's
q/k/v/out projections) replaced by the method's wrapper (`geoparam.linen.wrappers`),
its variables created at the layer's own path, so the variable tree keeps the
model's names; `drop_batchnorm=True` makes the model's `nn.BatchNorm` layers the
identity (the paper's ResNet-50 with GmP+IMN). Every layer kind of
`geoparam.kinds` is a candidate (`nn.Einsum` and `nn.ConvTranspose` included); a
selected `nn.ConvLocal` is an error naming it (exclude it to keep it plain).
`to_reparameterized` converts a trained plain model's variables (BatchNorm
folded into the layer before it when dropped) and `bake` converts back.

IMN's train/eval switch: the field `use_running_average`, or when None, the
running mean is used exactly when `batch_stats` is not mutable (Flax's usual
train step passes `mutable=['batch_stats']`, evaluation does not). It cannot
contradict the model silently: the interceptor sees the model's own flags, the
`use_running_average` of its BatchNorm calls (dropped ones too) and the
`deterministic` of its Dropout calls, and outside `init` a call raises
ValueError where they say training while `batch_stats` is immutable (a train
step that forgot `mutable=['batch_stats']` would train with IMN frozen at its
calibration mean; Flax's own BatchNorm raises there too) or every BatchNorm
says evaluation while `batch_stats` is mutable (IMN would update its mean). IMN
cannot simply follow those flags: a layer's IMN runs before the BatchNorm after
it reveals the flag. Models with neither layer go by mutability alone; an
explicit `use_running_average` is never checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
import dataclasses
import functools
import inspect
import operator
import re
from typing import Any

import flax
import flax.linen as nn
from flax import traverse_util
from flax.core import meta
import jax
import jax.numpy as jnp
import numpy as np

from geoparam import checks
from geoparam import conv
from geoparam import exact
from geoparam import kinds
from geoparam import methods
from geoparam import selection
from geoparam.linen import wrappers
from geoparam.selection import name as _name

__all__ = ['ReparamParamNotFoundError', 'Reparameterized', 'reparameterize', 'selected',
           'to_reparameterized', 'bake']

Where = Callable[[nn.Module, tuple[str, ...]], bool]


def _inputs(args, kwargs):
  return args[0] if args else next(iter(kwargs.values()))


class ReparamParamNotFoundError(flax.errors.ScopeParamNotFoundError):
  """Flax's `ScopeParamNotFoundError` with geoparam's hint: `Reparameterized.apply` was given
  variables without the method's params (typically the plain model's)."""

  def __init__(self, message):  # pylint: disable=super-init-not-called
    flax.errors.FlaxError.__init__(self, message)  # pylint: disable=non-parent-init-called


class Reparameterized(nn.Module):
  """`module` with its selected layers reparameterized; variables at the original paths.

  Build it with `reparameterize`. Call it like `module` (its `__call__`); other
  methods through `call(name, *args, **kwargs)`, or as with the plain model:
  `rp.apply(variables, x, method='encode')` (also `init`). `method` resolves
  against the user's model first: a name of a method its class defines, its
  unbound method (`Model.encode`, or `model.encode` bound), or any function
  `fn(module, *args)` (a lambda) runs with the user's model as `module`,
  reparameterized, as `model.apply(..., method=fn)` would; a function that
  `Reparameterized` itself defines (`Reparameterized.call`) or a name only it
  has (`'call'`) runs on `rp`, as Flax does.

  Attributes:
    module: the user's model (unchanged).
    method: a name in `geoparam.methods.REGISTRY` or a `geoparam.methods.Method`.
    where: `where(layer, path) -> bool` selects layers (default: all of
      registered layer kind, `geoparam.kinds`; a refused kind raises when
      selected); `path` is relative to `module`.
    exclude: layer names or '/'-joined paths kept plain (e.g. `['head']`).
    drop_batchnorm: replace the selected `nn.BatchNorm` layers by the identity.
    use_running_average: IMN's switch (None: by `batch_stats` mutability,
      checked against the model's BatchNorm/Dropout flags; see the module doc).
    options: the method's options (`momentum`, `initialization`, ...).
  """

  module: nn.Module
  method: str | methods.Method
  where: Where | None = None
  exclude: tuple[str, ...] = ()
  drop_batchnorm: bool = False
  use_running_average: bool | None = None
  options: Mapping[str, Any] = flax.core.FrozenDict()

  def setup(self):
    nn.share_scope(self, self.module)

  def get_method(self) -> methods.Method:
    """The method, built with `options`."""
    return methods.get(self.method, **self.options)

  def __call__(self, *args, **kwargs):
    """Runs `module(*args, **kwargs)` with the selected layers reparameterized."""
    return self.call('__call__', *args, **kwargs)

  @nn.nowrap
  def _resolve(self, method):
    """`method` for Flax's `apply`/`init`: the user's model's methods run through `call`."""
    if method is None:
      return None
    model = type(self.module)
    if isinstance(method, str):
      if (hasattr(type(self), method) and method != '__call__'
          and not (hasattr(model, method) and not hasattr(nn.Module, method))):
        return method  # one of Reparameterized's own ('call', ...)
      name = method  # the model's: a method, or a submodule its setup defines
      return lambda rp, *args, **kwargs: rp.call(name, *args, **kwargs)
    fn = method.__func__ if inspect.ismethod(method) and isinstance(method.__self__,
                                                                    nn.Module) else method
    checks.function('method', fn, 'a method name, a method or a function fn(module, *args)')
    if getattr(Reparameterized, getattr(fn, '__name__', ''), None) is fn:
      return fn  # Reparameterized's own method: Flax passes it `rp`
    return lambda rp, *args, **kwargs: rp.call(fn, *args, **kwargs)

  @nn.nowrap
  def apply(self, variables, *args, method=None, **kwargs):
    """`nn.Module.apply`; `method` may name or be a method of the user's model (see above).

    A variable of the method missing from `variables` (the plain model's variables given to
    `rp`) raises `ScopeParamNotFoundError` with a hint: convert them with `to_reparameterized`.
    """
    try:
      return super().apply(variables, *args, method=self._resolve(method), **kwargs)
    except flax.errors.ScopeParamNotFoundError as e:
      scope = re.search(r'in scope "([^"]*)"', str(e))
      path = tuple(p for p in scope.group(1).split('/') if p) if scope else None
      held = _lookup(variables, 'params', path) if scope else None
      if not isinstance(held, Mapping) or 'kernel' not in held:
        raise
      raise ReparamParamNotFoundError(
          f"{e} geoparam: {type(self.module).__name__}'s layer {_name(path)} is reparameterized "
          f"by {self.get_method().name!r}, but the variables hold {sorted(held)} there (the "
          "plain model's): convert them first, variables = geoparam.to_reparameterized(rp, "
          'plain_variables, *example_inputs) (new ones: rp.init).') from None

  @nn.nowrap
  def init_with_output(self, rngs, *args, method=None, **kwargs):
    """`nn.Module.init_with_output` (and so `init`), `method` resolved as in `apply`."""
    return super().init_with_output(rngs, *args, method=self._resolve(method), **kwargs)

  def call(self, method_name: str | Callable, *args, **kwargs):
    """Runs `getattr(module, method_name)(*args, **kwargs)` reparameterized.

    `method_name` may also be a function `fn(module, *args, **kwargs)` (e.g. the
    model's unbound method `Model.encode`), called with the user's model.
    """
    method = self.get_method()
    prefix = len(self.path)

    # A plain function: flax routes every Module method, private ones too, through the
    # interceptors, so the interceptor cannot be a method of this Module.
    def intercept(next_fun, args, kwargs, context):
      layer = context.module
      if pending and layer is pending[-1][0]:  # called below only to create its bias term
        return pending.pop()[1]()
      if (conv.bypassed() or context.method_name != '__call__'
          or not _in_model(layer, self)):
        return next_fun(*args, **kwargs)
      path = tuple(layer.path[prefix:])
      kind = _candidate(self, layer, path, seen)
      mode = _training_flag(layer, args, kwargs)
      if mode is not None:
        modes.append((path,) + mode)
      if isinstance(layer, nn.BatchNorm):
        if self.drop_batchnorm and selected(self, layer, path):
          return _drop(_inputs(args, kwargs))
      elif kind is not None and selected(self, layer, path):
        chosen.append(path)
        use_running_average = self.use_running_average
        if use_running_average is None:
          use_running_average = not layer.is_mutable_collection('batch_stats')
          imn_frozen.append(use_running_average)
        x = _inputs(args, kwargs)
        y = wrappers.call(layer, method, layer, x, use_running_average)
        if self.drop_batchnorm and layer.is_initializing() and not kind.has_bias(layer):
          bias_free.append((y, layer, x))
        return y
      return next_fun(*args, **kwargs)

    def _drop(x):
      """A dropped BatchNorm: the identity; at init, a bias-free layer whose output it gets
      receives the bias term the BatchNorm's shift needs (paper 002's ResNet: GmP's lam)."""
      for y, layer, inputs in bias_free:
        if y is x:
          pending.append((layer, lambda: wrappers.add_bias(layer, method, layer, inputs, y)))
          return layer(inputs)  # in the layer's own compact context, which may create variables
      return x

    seen, chosen, modes, imn_frozen, bias_free, pending = [], [], [], [], [], []
    with nn.intercept_methods(intercept):
      if isinstance(method_name, str):
        out = getattr(self.module, method_name)(*args, **kwargs)
      else:
        out = method_name(self.module, *args, **kwargs)
    if method_name in ('__call__', getattr(type(self.module), '__call__')):
      _check(self, seen, chosen)  # other methods may run a part of the model
    if method.imn is not None and imn_frozen and modes and not self.is_initializing():
      _check_imn_mode(self, imn_frozen[0], modes)
    return out


def _in_model(layer: nn.Module, model: nn.Module) -> bool:
  """Whether `layer` is `model` or one of its layers (its path below the model's), not a layer
  the model applies with variables it supplies itself (`head.apply({'params': {'kernel':
  tied}}, h)`, a tied head: a new root, path `()`), which stays plain."""
  return layer.scope is model.scope or len(layer.path) > len(model.path)


_FLAGS = {nn.BatchNorm: 'use_running_average', nn.Dropout: 'deterministic'}  # False: training


def _training_flag(layer: nn.Module, args, kwargs):
  """`(layer kind, flag, value)` of a BatchNorm or Dropout call, else None.

  The model's own train/eval switch as the layer computes it (its call argument, else its
  field): BatchNorm's `use_running_average` (False: training), Dropout's `deterministic`
  (False: training; True says nothing, dropout may be off while training). None where unset.
  """
  for kind, flag in _FLAGS.items():
    if isinstance(layer, kind):
      value = args[1] if len(args) > 1 else kwargs.get(flag)
      value = getattr(layer, flag) if value is None else value
      if value is None or isinstance(value, jax.core.Tracer) or (kind is nn.Dropout and value):
        return None
      return kind.__name__, flag, bool(value)
  return None


def _check_imn_mode(rp: Reparameterized, frozen: bool, modes) -> None:
  """Raises where IMN's mode (by `batch_stats` mutability) contradicts the model's own flags."""
  model, method = type(rp.module).__name__, rp.get_method().name
  shown = lambda rows: ', '.join(f'{k} {_name(p)} with {f}={v}' for p, k, f, v in rows[:3])
  training = [m for m in modes if not m[-1]]
  if frozen and training:
    raise ValueError(
        f'reparameterize({model}, {method!r}): the model runs in training mode '
        f'({shown(training)}) but batch_stats is not mutable, so IMN would silently use its '
        "frozen running mean: pass mutable=['batch_stats'] to apply in training steps (as for "
        "BatchNorm), or fix IMN's mode with reparameterize(..., use_running_average=True).")
  if not frozen and not training:
    raise ValueError(
        f'reparameterize({model}, {method!r}): the model runs in evaluation mode '
        f'({shown(modes)}) but batch_stats is mutable, so IMN would use batch means and update its '
        "running mean: evaluate without mutable=['batch_stats'], or fix IMN's mode with "
        'reparameterize(..., use_running_average=False) (e.g. BatchNorm frozen while IMN trains).')


def _candidate(rp, layer, path, seen) -> kinds.Kind | None:
  """The kind of a layer the transform may reparameterize (None for others), noting every
  candidate's path in `seen`; a selected layer of a refused kind raises."""
  kind = kinds.of(layer)
  if kind is not None or isinstance(layer, nn.BatchNorm):
    seen.append(path)
  if kind is not None and kind.refused:
    if selected(rp, layer, path):
      raise selection.refused(layer, path)
    return None
  return kind


def _check(rp: Reparameterized, seen, chosen) -> None:
  selection.check_selection(type(rp.module).__name__, rp.get_method().name, seen, chosen,
                            rp.where, rp.exclude)


def selected(rp: Reparameterized, layer: nn.Module, path: tuple[str, ...]) -> bool:
  """Whether `rp` reparameterizes (or drops) `layer` at `path` (relative to `rp.module`)."""
  return selection.selected(layer, path, rp.where, rp.exclude)


def reparameterize(model: nn.Module, method: str | methods.Method, *, where: Where | None = None,
                   exclude: Iterable[str] = (), drop_batchnorm: bool = False,
                   use_running_average: bool | None = None, **options) -> Reparameterized:
  """`model` with its kernel layers (`geoparam.kinds`) in `method` (`'gmp'`, `'gmp_imn'`, ...).

  Args:
    model: any linen module; its source is not edited.
    method: a name in `geoparam.methods.REGISTRY` (`'gmp'`, `'gmp_imn'`, `'lcw'`,
      `'cwn'`, `'wn'`, or any registered one) or a `geoparam.methods.Method`.
    where: optional `where(layer, path) -> bool` over the layer instance and its
      path of names relative to `model`.
    exclude: layer names (or '/'-joined paths) kept plain, e.g. the output layer.
    drop_batchnorm: make the model's BatchNorm layers (those `where`/`exclude`
      select) the identity, as the paper's GmP+IMN ResNet-50 does.
    use_running_average: IMN's switch; None decides by `batch_stats` mutability
      and raises where the model's BatchNorm/Dropout flags contradict it.
    **options: the method's options (its factory's arguments), e.g.
      `momentum=0.9`, `initialization='layer'`, `epsilon=1e-6`.

  Returns:
    A `Reparameterized` linen module: `rp.init`/`rp.apply` as with `model`, its
    variables at the original paths. `to_reparameterized(rp, variables, x)` gives
    it a trained model's weights; `bake(rp, variables, x)` gives them back.
  """
  if not isinstance(model, nn.Module):
    hint = ('pass an instance, e.g. Model()' if isinstance(model, type) else
            'for an NNX model use geoparam.nnx.reparameterize' if hasattr(model, '__dict__')
            and 'nnx' in type(model).__module__ + ''.join(c.__module__ for c in type(model).__mro__)
            else 'pass the flax.linen Module instance itself')
    raise TypeError(f'reparameterize takes a flax.linen Module instance, got {model!r:.80} '
                    f'({type(model).__name__}): {hint}.')
  if isinstance(model, Reparameterized):
    raise TypeError(
        f'reparameterize takes a plain model, got one already reparameterized by '
        f'{model.get_method().name!r}: a linen transform applies one method. To mix methods, '
        'wrap the other layers in the model itself (geoparam.Reparam(layer, method), '
        'geoparam.GmP(layer), ...), or use geoparam.nnx.reparameterize, which converts in place '
        'and applies again.')
  built = methods.get(method, **options)  # unknown methods and options fail here, not at a call
  exclude = selection.check_arguments(where, exclude, drop_batchnorm, use_running_average, built)
  return Reparameterized(model, method, where=where, exclude=exclude,
                         drop_batchnorm=drop_batchnorm, use_running_average=use_running_average,
                         options=flax.core.FrozenDict(options))


# ----------------------------------------------------------------------------- weights

@dataclasses.dataclass
class _Call:
  layer: nn.Module
  inputs: Any
  output: Any


def _record(rp: Reparameterized, variables, args, kwargs):
  """Runs the plain model once; returns `(layers, dropped, out)`: selected calls by path, first
  call each, the dropped BatchNorms (`_dropped`) and what the model returned.

  `layers` are the selected calls of a layer kind (`geoparam.kinds`) (path -> _Call). With
  `variables` None, only shapes are traced (`jax.eval_shape` of the plain model's `init`, whose
  abstract variables, boxed, are `out`).
  """
  layers, norms, seen, roots = {}, {}, [], []

  def intercept(next_fun, a, k, context):
    m = context.module
    if not roots:
      roots.append(m)  # the model: the outermost call's module
    y = next_fun(*a, **k)
    if (context.method_name == '__call__' and not conv.bypassed()
        and _in_model(m, roots[0])):
      path = tuple(m.path)
      kind = _candidate(rp, m, path, seen)
      calls = norms if isinstance(m, nn.BatchNorm) and rp.drop_batchnorm else layers
      if (kind is not None or calls is norms) and selected(rp, m, path):
        calls.setdefault(path, _Call(m.clone(parent=None), _inputs(a, k), y))
    return y

  try:
    with nn.intercept_methods(intercept):
      if variables is None:
        out = jax.eval_shape(lambda: rp.module.init(jax.random.key(0), *args, **kwargs))
      else:
        out = rp.module.apply(variables, *args, **kwargs)
  except (flax.errors.ScopeParamNotFoundError, flax.errors.ScopeCollectionNotFound,
          flax.errors.ScopeVariableNotFoundError, flax.errors.ScopeParamShapeError) as e:
    raise ValueError(
        f'to_reparameterized: the variables do not fit the plain model {type(rp.module).__name__} '
        f'(they have collections {sorted(variables)}): {str(e).split(" (https")[0]} Pass the '
        "plain model's variables (model.init's or training's, with their params and batch_stats), "
        "not rp's.") from None
  except flax.errors.ModifyScopeVariableError as e:
    raise ValueError(
        f'to_reparameterized: the plain model updates its statistics on these inputs '
        f'({str(e).split(" (https")[0]}): give evaluation-mode arguments, e.g. train=False.'
        ) from None
  _check(rp, seen, list(layers))
  return layers, _dropped(layers, norms), out


def _dropped(layers, norms):
  """`{layer path: (BatchNorm path, BatchNorm)}` for each dropped BatchNorm (`norms`: their calls
  by path), fed by that layer's output."""
  outputs = {p: c.output for p, c in layers.items()}
  layout_of = lambda p: exact.layout_of(layers[p].layer, jnp.shape(layers[p].inputs), p)
  pairs = {}
  for bn_path, call in norms.items():
    x, axis = call.inputs, call.layer.axis
    pairs[exact.fed_layer(bn_path, x, outputs, layout_of, axis, tuple(
        jnp.shape(x)[a] for a in kinds.ints(axis)))] = bn_path, call.layer
  return pairs


def _layer(call: _Call, params, path):
  """`(kind, kernel, layout, stack)` of a recorded layer: its kernel from `params` (its variables
  by name), unboxed, its layout on its inputs and the axes a lifted transform stacked it on."""
  kind = kinds.of(call.layer)
  kernel = meta.unbox(exact.kernel_of(kind, params, path))
  layout = exact.layout_of(call.layer, jnp.shape(call.inputs), path)
  return kind, kernel, layout, exact.stack_of(jnp.shape(kernel), layout, path)


def _put(flat, prefix, node=None):
  """`flat` (variables as `traverse_util.flatten_dict` gives them) with what it holds under
  `prefix` replaced by `node` (a dict by name; None: removed)."""
  kept = {k: v for k, v in flat.items() if k[:len(prefix)] != prefix}
  return {**kept, **{prefix + (k,): v for k, v in (node or {}).items()}}


def _like(abstract, value):
  """`value` in the partitioning box of `abstract` (the plain model's init's), if it has one."""
  return abstract.replace_boxed(value) if isinstance(abstract, meta.AxisMetadata) else value


def _lookup(variables, collection: str, path):
  """`variables[collection][path...]`, or None where it is missing."""
  try:
    return functools.reduce(operator.getitem, path, variables[collection])
  except (KeyError, TypeError, IndexError):
    return None


def _check_args(fn: str, rp, variables) -> None:
  if not isinstance(rp, Reparameterized):
    raise TypeError(f'{fn} takes the model geoparam.reparameterize returned, got {rp!r:.60} '
                    f'({type(rp).__name__}): call {fn}(geoparam.reparameterize(model, method), '
                    'variables, *example_inputs).')
  if not isinstance(variables, Mapping):
    raise TypeError(f'{fn}: variables must be a dict of collections ({{"params": ...}}, as '
                    f'init returns), got {type(variables).__name__}.')


def to_reparameterized(rp: Reparameterized, variables, *args, **kwargs):
  """Variables of `rp` (from `reparameterize`) with the same function as the plain `variables`.

  Runs the plain model once on `*args, **kwargs` (give evaluation-mode
  arguments, e.g. `train=False`; a real batch calibrates IMN): finds the selected
  layers and the BatchNorm layers fed by them, folds each dropped BatchNorm
  (evaluation statistics) into its layer, converts every layer exactly and
  returns the new variables. Evaluation outputs of `rp` equal the plain model's
  up to float rounding.

  Raises ValueError naming the layer for what has no exact form: a dropped
  BatchNorm whose input is not a selected layer's output, a zero or tiny
  kernel column (GmP), a kernel whose units do not sum to zero (LCW, CWN).

  IMN's running mean starts at the batch mean of the layer's input, and `lam`
  absorbs it, for dense layers and convs that pad no zeros; zero-padded convs
  start it at 0 (with a nonzero mean, `conv(x - m)` differs at the borders), as
  do bias-free layers (nothing could absorb it).

  Returns:
    A new variables dict for `rp` (`params`, and `batch_stats` where IMN or the
    model's own BatchNorms keep statistics); `variables` is not changed.
  """
  _check_args('to_reparameterized', rp, variables)
  method = rp.get_method()
  layers, dropped, _ = _record(rp, variables, args, kwargs)
  new = traverse_util.flatten_dict(variables, keep_empty_nodes=True)
  folds = {}
  for layer_path, (bn_path, bn) in dropped.items():  # folded into the layer that feeds it
    stats = meta.unbox(_lookup(variables, 'batch_stats', bn_path))
    params = meta.unbox(_lookup(variables, 'params', bn_path))
    folds[layer_path] = exact.bn_affine(stats['mean'], stats['var'], bn.epsilon,
                                        params['scale'] if bn.use_scale else None,
                                        params['bias'] if bn.use_bias else None)
    new = _put(_put(new, ('params',) + bn_path), ('batch_stats',) + bn_path)
  for path, call in layers.items():
    sp = _lookup(variables, 'params', path)
    kind, kernel, layout, stack = _layer(call, sp, path)
    bias = meta.unbox(sp[kind.bias]) if kind.bias in sp else None
    stored, mean = exact.convert_layer(method, call.layer, kernel, bias, call.inputs, path,
                                       folds.get(path), stack)
    box, n = sp[kind.kernel], len(stack)
    names = tuple(getattr(box, 'names', ())) + (None,) * (n + len(layout.kernel_shape))
    box = None if not isinstance(box, nn.Partitioned) else dataclasses.replace(
        box, names=names[:n] + layout.names(names[n:n + len(layout.kernel_shape)]))  # as the
    # wrappers make them; fewer names than axes name the leading ones (a PartitionSpec's rule)
    new = _put(new, ('params',) + path, {
        k: wrappers.box_like(v, stack + layout.method_shape, box, n) for k, v in stored.items()})
    if mean is not None:
      new[('batch_stats',) + path + ('input_mean_norm', 'mean')] = mean
  # a collection emptied (the dropped BatchNorms' statistics were all it held) goes, as in rp.init
  return traverse_util.unflatten_dict(new)


def bake(rp: Reparameterized, variables, *args, approximate_borders: bool = False, **kwargs):
  """Plain variables of `rp.module` with the same evaluation outputs as `rp` with `variables`.

  `*args, **kwargs` are example inputs of the plain model (shapes are traced,
  nothing runs). Dropped BatchNorm layers come back as the identity (mean 0,
  variance 1, scale `sqrt(1 + epsilon)`, bias 0). IMN's running mean is folded
  into the bias; for zero-padded convs that is exact only away from the
  borders, so it raises unless `approximate_borders=True`.

  Returns:
    A new variables dict for `rp.module` (the plain model), boxed like its
    `init` where `variables` hold partitioning boxes; `variables` is not changed.
  """
  _check_args('bake', rp, variables)
  checks.flag('approximate_borders', approximate_borders, 'bake')
  if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(variables)):
    raise TypeError('bake: the variables are traced (bake called inside jax.jit, vmap or grad): '
                    'it converts concrete weights exactly, in float64 on the host; call it '
                    'outside the transformation, on the variables it returns.')
  method = rp.get_method()
  layers, dropped, boxes = _record(rp, None, args, kwargs)
  shapes = meta.unbox(boxes)
  new = traverse_util.flatten_dict(variables, keep_empty_nodes=True)
  # what bake writes gets the plain model's partitioning boxes where the variables hold boxes
  is_box = lambda x: isinstance(x, nn.Partitioned)
  like = boxes if any(map(is_box, jax.tree.leaves(variables, is_leaf=is_box))) else shapes
  biases = {}  # layers without a bias of their own: their bias goes to the dropped BatchNorm
  given = ("pass the variables to_reparameterized or training returned, with their params and "
           f"batch_stats (these have collections {sorted(variables)})")
  for path, call in layers.items():
    layer = call.layer
    kind, plain_kernel, layout, stack = _layer(call, _lookup(shapes, 'params', path), path)
    stored = _lookup(variables, 'params', path)
    specs = method.params(layout.method_shape, methods.Layer(use_bias=kind.has_bias(layer)),
                          lambda: None)
    names = sorted(specs)
    if not isinstance(stored, Mapping) or not set(names) <= set(stored):
      held = sorted(stored) if isinstance(stored, Mapping) else None
      raise ValueError(
          f'bake: the variables lack params/{_name(path)} of layer {_name(path)} '
          f'({method.name}\'s {names}' + (f'; they hold {held}' if held else '') + '): '
          + ("these are the plain model's; " if held and 'kernel' in held else '') + given + '.')
    held = {n: jnp.shape(meta.unbox(stored[n])) for n in names}
    need = {n: stack + tuple(specs[n].shape) for n in names}
    if held != need:
      raise ValueError(
          f'bake: the example inputs give layer {_name(path)} inputs of shape '
          f'{tuple(jnp.shape(call.inputs))}, for which {method.name!r} needs params {need}, but '
          f'the variables hold {held}: pass example inputs of the shape the variables were made '
          'for (only their shapes are used).')
    mean = None
    if method.imn is not None:
      mean = _lookup(variables, 'batch_stats', path + ('input_mean_norm', 'mean'))
      if mean is None:
        raise ValueError(
            f"bake: the variables lack IMN's running mean batch_stats/{_name(path)}/"
            f'input_mean_norm/mean for layer {_name(path)} ({method.name!r} has IMN): {given}.')
      mean = np.asarray(mean, np.float64)
      new = _put(new, ('batch_stats',) + path + ('input_mean_norm',))
    kernel, bias = exact.plain_layer(method, layer, meta.unbox(dict(stored)), layout, mean, path,
                                     approximate_borders, stack)
    own = _lookup(like, 'params', path)
    plain = {kind.kernel: _like(own[kind.kernel], jnp.asarray(kernel, plain_kernel.dtype))}
    if kind.has_bias(layer):
      plain[kind.bias] = _like(own[kind.bias], jnp.asarray(bias, plain_kernel.dtype))
    else:
      biases[path] = bias
    new = _put(new, ('params',) + path, plain)
  for layer_path, (bn_path, bn) in dropped.items():
    running = _lookup(shapes, 'batch_stats', bn_path + ('mean',))
    carried = biases.pop(layer_path, 0.0)  # the bias of a layer that has none
    stats, affine = exact.identity_batchnorm(running.shape, bn.epsilon, bn.use_scale,
                                             bn.use_bias, running.dtype, running.dtype, carried,
                                             layer_path, bn_path)
    own = _lookup(like, 'params', bn_path)  # None where the BatchNorm has no scale and bias
    new = _put(_put(new, ('batch_stats',) + bn_path, stats), ('params',) + bn_path,
               {k: _like(own[k], v) for k, v in affine.items()})
  for layer_path, bias in biases.items():
    if np.any(bias != 0):
      raise exact.bias_free_error(method, layer_path)
  return traverse_util.unflatten_dict(new)  # a collection emptied (IMN's means only) goes
