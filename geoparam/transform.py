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
q/k/v/out projections) replaced by the method's wrapper (`geoparam.wrappers`),
its variables created at the layer's own path, so the variable tree keeps the
model's names; `drop_batchnorm=True` makes the model's `nn.BatchNorm` layers the
identity (the paper's ResNet-50 with GmP+IMN). A selected `nn.Einsum`,
`nn.ConvLocal` or `nn.ConvTranspose` is an error naming it (exclude it to keep
it plain).
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
import inspect
import math
from typing import Any

import flax
import flax.linen as nn
from flax.core import meta
import jax
import jax.numpy as jnp
import numpy as np

from geoparam import methods
from geoparam import wrappers
from geoparam.methods import run

__all__ = ['Reparameterized', 'reparameterize', 'selected', 'excluded', 'check_selection',
           'to_reparameterized', 'bake', 'bn_affine', 'convert_layer', 'plain_layer']

Where = Callable[[nn.Module, tuple[str, ...]], bool]


def _inputs(args, kwargs):
  return args[0] if args else next(iter(kwargs.values()))


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
      `wrappers.LAYER_TYPES`; it also sees `wrappers.UNSUPPORTED_TYPES`, which
      raise when selected); `path` is relative to `module`.
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
    if not callable(fn):
      raise TypeError(f'method must be a method name, a method or a function fn(module, *args), '
                      f'got {method!r:.60} of type {type(method).__name__}.')
    if getattr(Reparameterized, getattr(fn, '__name__', ''), None) is fn:
      return fn  # Reparameterized's own method: Flax passes it `rp`
    return lambda rp, *args, **kwargs: rp.call(fn, *args, **kwargs)

  @nn.nowrap
  def apply(self, variables, *args, method=None, **kwargs):
    """`nn.Module.apply`; `method` may name or be a method of the user's model (see above)."""
    return super().apply(variables, *args, method=self._resolve(method), **kwargs)

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
      if wrappers.bypassed() or context.method_name != '__call__':
        return next_fun(*args, **kwargs)
      path = tuple(layer.path[prefix:])
      if isinstance(layer, _CANDIDATES):
        seen.append(path)
      mode = _training_flag(layer, args, kwargs)
      if mode is not None:
        modes.append((path,) + mode)
      _refuse_unsupported(self, layer, path)
      if isinstance(layer, nn.BatchNorm):
        if self.drop_batchnorm and selected(self, layer, path):
          return _drop(_inputs(args, kwargs))
      elif isinstance(layer, wrappers.LAYER_TYPES) and selected(self, layer, path):
        chosen.append(path)
        use_running_average = self.use_running_average
        if use_running_average is None:
          use_running_average = not layer.is_mutable_collection('batch_stats')
          imn_frozen.append(use_running_average)
        x = _inputs(args, kwargs)
        y = wrappers.call(layer, method, layer, x, use_running_average)
        if self.drop_batchnorm and layer.is_initializing() and not getattr(layer, 'use_bias', True):
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
    if method.imn is not None and imn_frozen and not self.is_initializing():
      _check_imn_mode(self, imn_frozen[0], modes)
    return out


def _training_flag(layer: nn.Module, args, kwargs):
  """`(layer kind, flag, value, training)` of a BatchNorm or Dropout call, else None.

  The model's own train/eval switch as the layer computes it (its call argument, else its
  field): BatchNorm's `use_running_average` (False: training), Dropout's `deterministic`
  (False: training; True says nothing, dropout may be off while training). None where unset.
  """
  if isinstance(layer, nn.BatchNorm):
    kind, flag = 'BatchNorm', 'use_running_average'
  elif isinstance(layer, nn.Dropout):
    kind, flag = 'Dropout', 'deterministic'
  else:
    return None
  value = args[1] if len(args) > 1 else kwargs.get(flag)
  value = getattr(layer, flag) if value is None else value
  if value is None or isinstance(value, jax.core.Tracer):
    return None
  training = not bool(value)
  if kind == 'Dropout' and not training:
    return None
  return kind, flag, bool(value), training


def _check_imn_mode(rp: Reparameterized, frozen: bool, modes) -> None:
  """Raises where IMN's mode (by `batch_stats` mutability) contradicts the model's own flags."""
  if not modes:
    return
  model, method = type(rp.module).__name__, rp.get_method().name
  shown = lambda rows: ', '.join(f'{k} {_name(p)} with {f}={v}' for p, k, f, v, _ in rows[:3])
  training = [m for m in modes if m[-1]]
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


_CANDIDATES = (nn.BatchNorm,) + wrappers.LAYER_TYPES + wrappers.UNSUPPORTED_TYPES


_WHY_UNSUPPORTED = {
    'Einsum': 'its kernel has no fixed split into fan-in and output units',
    'ConvLocal': 'it has one kernel per output position, not one per unit',
    'ConvTranspose': 'a unit\'s weights are spread over the output positions (IMN\'s exact '
                     'fold and the conversion assume a conv\'s windows)',
}


def unsupported(kind: str, path, framework: str = 'nn') -> ValueError:
  """The error for a selected layer the transforms cannot reparameterize (Einsum, ConvLocal,
  ConvTranspose)."""
  name = '/'.join(str(p) for p in path) or '<root>'
  why = _WHY_UNSUPPORTED.get(kind, 'it is not a Dense/Conv/DenseGeneral layer')
  return ValueError(
      f'layer {name!r} is an {framework}.{kind}, which geoparam cannot reparameterize ({why}), '
      'and the selection picks it. '
      f'Keep it plain: exclude=[{str(path[-1]) if path else name!r}] (or its \'/\'-joined '
      'path), or a where= that leaves it out.')


def _refuse_unsupported(rp, layer, path) -> None:
  if isinstance(layer, wrappers.UNSUPPORTED_TYPES) and selected(rp, layer, path):
    raise unsupported(type(layer).__name__, path)


def excluded(path: tuple, exclude) -> bool:
  """Whether an `exclude` entry names the layer at `path`: its name, or its '/'-joined path.

    >>> excluded(('blocks', 'head'), ['head']), excluded(('blocks', 'head'), ['blocks/head'])
    (True, True)
    >>> excluded(('blocks', 'head'), ['blocks'])
    False
  """
  names = tuple(str(p) for p in path)
  return '/'.join(names) in exclude or bool(names and names[-1] in exclude)


def check_selection(model: str, method: str, seen, chosen, where, exclude,
                    kinds: str = 'Dense, Conv, DenseGeneral', verb: str = 'ran') -> None:
  """Raises where the selection is a silent no-op: no layer selected, or an `exclude` entry
  that names no layer (a typo would reparameterize the layer it meant to keep).

  `model`, `method`: names for the message; `seen`: the paths of the model's candidate
  layers (`kinds` and BatchNorm; what the model `verb`, 'ran' or 'holds'); `chosen`: those
  reparameterized. The linen and the NNX transform call it.
  """
  layers = sorted({'/'.join(str(k) for k in p) for p in seen})
  shown = ', '.join(layers[:12]) + (f' (and {len(layers) - 12} more)' if len(layers) > 12 else '')
  if not chosen:
    raise ValueError(
        f'reparameterize({model}, {method!r}): no layer was selected ({kinds}; '
        f'where={where!r}, exclude={list(exclude)}); the model {verb} {shown or "none"}. A '
        'selection that matches nothing leaves the model plain.')
  unmatched = [e for e in exclude if not any(excluded(p, (e,)) for p in seen)]
  if unmatched:
    raise ValueError(f'reparameterize({model}): exclude entries {unmatched} name no layer the '
                     f'model {verb} ({shown}); check the names (a layer name or a \'/\'-joined '
                     'path).')


def _check(rp: Reparameterized, seen, chosen) -> None:
  check_selection(type(rp.module).__name__, rp.get_method().name, seen, chosen, rp.where,
                  rp.exclude)


def selected(rp: Reparameterized, layer: nn.Module, path: tuple[str, ...]) -> bool:
  """Whether `rp` reparameterizes (or drops) `layer` at `path` (relative to `rp.module`)."""
  if excluded(path, rp.exclude):
    return False
  return rp.where is None or bool(rp.where(layer, path))


def reparameterize(model: nn.Module, method: str | methods.Method, *, where: Where | None = None,
                   exclude: Iterable[str] = (), drop_batchnorm: bool = False,
                   use_running_average: bool | None = None, **options) -> Reparameterized:
  """`model` with its Dense/Conv/DenseGeneral layers in `method` (`'gmp'`, `'gmp_imn'`, ...).

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
  """
  if not isinstance(model, nn.Module):
    hint = ('pass an instance, e.g. Model()' if isinstance(model, type) else
            'for an NNX model use geoparam.nnx.reparameterize' if hasattr(model, '__dict__')
            and 'nnx' in type(model).__module__ + ''.join(c.__module__ for c in type(model).__mro__)
            else 'pass the flax.linen Module instance itself')
    raise TypeError(f'reparameterize takes a flax.linen Module instance, got {model!r:.80} '
                    f'({type(model).__name__}): {hint}.')
  if isinstance(exclude, str):
    exclude = (exclude,)
  methods.get(method, **options)  # unknown methods and options fail here, not at the first call
  return Reparameterized(model, method, where=where, exclude=tuple(exclude),
                         drop_batchnorm=drop_batchnorm, use_running_average=use_running_average,
                         options=flax.core.FrozenDict(options))


# ----------------------------------------------------------------------------- weights

@dataclasses.dataclass
class _Call:
  layer: nn.Module
  inputs: Any
  output: Any


def _record(rp: Reparameterized, variables, args, kwargs, *, abstract: bool):
  """Runs the plain model once; returns `(layers, norms)`: selected calls by path, first call each.

  `layers` are the selected Dense/Conv/DenseGeneral calls, `norms` every BatchNorm
  call (path -> _Call). With `abstract`, only shapes are traced (`jax.eval_shape`).
  """
  layers, norms, seen = {}, {}, []

  def intercept(next_fun, a, k, context):
    m = context.module
    y = next_fun(*a, **k)
    if context.method_name == '__call__' and not wrappers.bypassed():
      path = tuple(m.path)
      if isinstance(m, _CANDIDATES):
        seen.append(path)
      _refuse_unsupported(rp, m, path)
      if isinstance(m, nn.BatchNorm):
        norms.setdefault(path, _Call(m.clone(parent=None), _inputs(a, k), y))
      elif isinstance(m, wrappers.LAYER_TYPES) and selected(rp, m, path):
        layers.setdefault(path, _Call(m.clone(parent=None), _inputs(a, k), y))
    return y

  def run(v):
    with nn.intercept_methods(intercept):
      if variables is None:
        return rp.module.init(jax.random.key(0), *args, **kwargs)
      return rp.module.apply(v, *args, **kwargs)

  try:
    if abstract:
      jax.eval_shape(run, variables)
    else:
      run(variables)
  except (flax.errors.ScopeParamNotFoundError, flax.errors.ScopeCollectionNotFound,
          flax.errors.ScopeVariableNotFoundError, flax.errors.ScopeParamShapeError) as e:
    raise ValueError(
        f'to_reparameterized: the variables do not fit the plain model {type(rp.module).__name__} '
        f'(they have {_collections(variables)}): {str(e).split(" (https")[0]} Pass the plain '
        "model's variables (model.init's or training's, with their params and batch_stats), not "
        "rp's.") from None
  except flax.errors.ModifyScopeVariableError as e:
    raise ValueError(
        f'to_reparameterized: the plain model updates its statistics on these inputs '
        f'({str(e).split(" (https")[0]}): give evaluation-mode arguments, e.g. train=False.'
        ) from None
  _check(rp, seen, list(layers))
  return layers, norms


def _dropped(rp, layers, norms):
  """`{layer path: BatchNorm path}` for each dropped BatchNorm, fed by that layer's output."""
  pairs = {}
  for bn_path, call in norms.items():
    if not (rp.drop_batchnorm and selected(rp, call.layer, bn_path)):
      continue
    producer = [p for p, c in layers.items() if c.output is call.inputs]
    if not producer:
      raise ValueError(
          f'BatchNorm {_name(bn_path)} is dropped but its input is not the output of a '
          'reparameterized Dense/Conv layer, so it cannot be folded (keep it with '
          'drop_batchnorm=False, or exclude it through `where`/`exclude`).')
    check_fold(layers[producer[0]].layer, producer[0], bn_path)
    pairs[producer[0]] = bn_path
  return pairs


def check_fold(layer, path, bn_path) -> None:
  """Raises unless a dropped BatchNorm can be folded into `layer` (one output axis)."""
  features = wrappers.feature_shape(layer)
  if len(features) > 1:
    raise ValueError(
        f'BatchNorm {_name(bn_path)} is dropped but the layer {_name(path)} before it has '
        f'several output axes {features}: its per-channel affine cannot be carried by that '
        "layer's bias both ways (keep it with drop_batchnorm=False, or exclude it).")


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _pop(tree, path):
  """Removes the node at `path` (and parents left empty)."""
  if len(path) == 1:
    tree.pop(path[0], None)
    return
  if path[0] in tree:
    _pop(tree[path[0]], path[1:])
    if not tree[path[0]]:
      del tree[path[0]]


def _put(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _unfrozen(variables):
  return jax.tree.map(lambda x: x, flax.core.unfreeze(meta.unbox(variables)))


def _name(path):
  return '/'.join(str(p) for p in path) or '<root>'


def _collections(variables) -> str:
  """The collections `variables` hold, for messages."""
  if isinstance(variables, Mapping):
    return f'collections {sorted(variables)}'
  return f'a {type(variables).__name__}'


def _lookup(variables, collection: str, path):
  """`variables[collection][path...]`, or None where it is missing."""
  try:
    return _get(variables[collection], path)
  except (KeyError, TypeError, IndexError):
    return None


def bn_affine(mean, var, epsilon: float, scale=None, bias=None):
  """`(s, t)` float64 with `BatchNorm(z) = s * z + t` in evaluation mode, `(features,)` each.

  `mean`, `var`: the running statistics; `scale`, `bias`: the affine params (None
  when the norm has none).
  """
  s = 1.0 / np.sqrt(np.asarray(var, np.float64) + epsilon)
  if scale is not None:
    s = s * np.asarray(scale, np.float64)
  t = -np.asarray(mean, np.float64) * s
  if bias is not None:
    t = t + np.asarray(bias, np.float64)
  return s, t


def _bn_affine(bn: nn.BatchNorm, variables, path):
  """`bn_affine` of a linen BatchNorm at `path` of `variables`."""
  stats = _get(variables['batch_stats'], path)
  params = _get(variables.get('params', {}), path) if bn.use_scale or bn.use_bias else {}
  return bn_affine(stats['mean'], stats['var'], bn.epsilon,
                   params['scale'] if bn.use_scale else None,
                   params['bias'] if bn.use_bias else None)


def _is_conv(layer) -> bool:
  """A linen or NNX conv (the transforms' helpers read Flax's field names, either framework)."""
  return hasattr(layer, 'kernel_size')


def _padding_free(layer) -> bool:
  """Whether `conv(x - m) == conv(x) - w^T m` everywhere (no zero is padded or inserted)."""
  if not _is_conv(layer):
    return True
  dilation = layer.input_dilation
  if dilation is not None and any(d != 1 for d in np.atleast_1d(dilation)):
    return False
  padding = layer.padding
  if isinstance(padding, str):
    return padding.upper() in ('VALID', 'CIRCULAR', 'REFLECT')
  return not np.any(np.asarray(padding))


def _flat_mean(layer, x):
  """The IMN mean of a layer input as the wrapper computes it, float64 `(fan_in_part,)`."""
  x = np.asarray(x, np.float64)
  flat = run.flatten_contracted(x, wrappers.contract_axes(layer, x.ndim))
  return flat.reshape(-1, flat.shape[-1]).mean(0)


def _mean_dot(layer, mean, kernel):
  """`w_f^T m` per unit `(F,)`: the IMN running mean `m` against a kernel in the method's shape.

  A conv sees the channels of its group at every window position; a dense layer
  the flattened contracted axes.
  """
  features = kernel.shape[-1]
  if _is_conv(layer):
    groups = layer.feature_group_count
    per_unit = np.repeat(mean.reshape(groups, -1), features // groups, axis=0)  # (F, C_in / g)
    window_sum = kernel.reshape((-1,) + kernel.shape[-2:]).sum(0)  # (C_in / g, F)
    return np.einsum('cf,fc->f', window_sum, per_unit)
  return mean @ kernel.reshape(-1, features)


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
  """
  method = rp.get_method()
  layers, norms = _record(rp, variables, args, kwargs, abstract=False)
  new = _unfrozen(variables)
  new.setdefault('params', {})
  folds = {}
  for layer_path, bn_path in _dropped(rp, layers, norms).items():
    folds[layer_path] = _bn_affine(norms[bn_path].layer, variables, bn_path)
    for col in ('params', 'batch_stats'):
      if col in new:
        _pop(new[col], bn_path)
  for path, call in layers.items():
    sp = _get(variables['params'], path)
    kernel = meta.unbox(sp['kernel'])
    bias = meta.unbox(sp['bias']) if 'bias' in sp else None
    stored, mean = convert_layer(method, call.layer, kernel, bias, call.inputs, path,
                                 folds.get(path), _stacked(jnp.shape(kernel), call, path))
    _put(new['params'], path, stored)
    if mean is not None:
      _put(new.setdefault('batch_stats', {}), path + ('input_mean_norm',), {'mean': mean})
  return new


def _stacked(kernel_shape, call: _Call, path) -> tuple[int, ...]:
  """The leading axes a lifted transform (`nn.scan`, `nn.vmap`) stacked the layer's variables
  on: `()` for a layer of its own, `(L,)` for a layer of a scanned block.

  The stored kernel is the layer's own kernel (for its recorded input) with these axes in
  front (`variable_axes={'params': 0}`, as flax's examples scan and vmap); anything else is
  refused by name.
  """
  own = tuple(wrappers.layer_kernel_shape(call.layer, tuple(call.inputs.shape), _name(path)))
  extra = len(kernel_shape) - len(own)
  if extra < 0 or tuple(kernel_shape[extra:]) != own:
    raise ValueError(
        f'layer {_name(path)}: its stored kernel has shape {tuple(kernel_shape)}, but the layer '
        f'computes with a {own} kernel: a layer stacked by nn.scan/nn.vmap must have its stacked '
        "axes in front (variable_axes={'params': 0}); other axes are not supported.")
  return tuple(kernel_shape[:extra])


def _slice_path(path, index, stack):
  """`path` naming one layer of a stack: `('blocks', 'up[2]')` (unchanged when not stacked)."""
  if not stack:
    return path
  return path[:-1] + (f'{path[-1]}[{",".join(str(i) for i in index)}]',)


def convert_layer(method: methods.Method, layer: nn.Module, kernel, bias, inputs, path=(),
                  fold=None, stack: tuple[int, ...] = ()):
  """One trained layer's `(kernel, bias)` as `method`'s variables, exactly (float64 inside).

  Args:
    method: a `geoparam.methods.Method` (or a registry name).
    layer: the layer (its fields; linen or NNX), `kernel` and `bias` (None: no bias) its params
      in its own layout (a DenseGeneral's `(*contracted, *features)`).
    inputs: the layer's input on an example batch (calibrates IMN; shapes only otherwise).
    path: for error messages.
    fold: optional `(s, t)` of a following BatchNorm folded in (`bn_affine`).
    stack: the leading axes of a layer stacked by a lifted transform (`nn.scan`,
      `nnx.vmap`): `kernel`, `bias`, `fold` and what comes back carry them in front,
      and each layer of the stack is converted on its own (errors name it, `up[2]`).

  Returns:
    `(stored, mean)`: the params `{name: array}` in the kernel's dtype, and IMN's
    running mean `(fan_in_part,)` (None without IMN).
  """
  method = methods.get(method)
  pieces = [_convert_one(method, layer, kernel[i], None if bias is None else bias[i], inputs,
                         _slice_path(path, i, stack),
                         None if fold is None else (fold[0][i], fold[1][i]))
            for i in np.ndindex(stack)]
  if not stack:
    return pieces[0]
  join = lambda *xs: jnp.stack(xs).reshape(stack + jnp.shape(xs[0]))
  mean = None if pieces[0][1] is None else join(*[p[1] for p in pieces])
  return jax.tree.map(join, *[p[0] for p in pieces]), mean


def _convert_one(method, layer, kernel, bias, inputs, path, fold):
  """`convert_layer` of one layer."""
  dtype = jnp.asarray(kernel).dtype
  kernel = np.asarray(kernel, np.float64)
  features = wrappers.feature_shape(layer)
  bias = np.zeros(features) if bias is None else np.asarray(bias, np.float64)
  if fold is not None:
    s, t = fold
    kernel, bias = kernel * s, bias * s + t
  # A dropped BatchNorm's shift belongs to the layer before it, bias-free or not.
  use_bias = getattr(layer, 'use_bias', True) or fold is not None
  kernel = kernel.reshape(wrappers.method_shape(layer, kernel.shape))  # units: every output
  bias = bias.reshape(-1)
  imn = method.imn is not None
  # a layer inside a lifted transform (nn.scan, nn.vmap, nn.remat) has traced inputs: its
  # running mean starts at 0 (exact as well), not at the batch mean
  calibrate = imn and use_bias and _padding_free(layer) and not isinstance(inputs, jax.core.Tracer)
  mean = _flat_mean(layer, inputs) if calibrate else None
  if mean is not None:  # u^T (x - m) + b' == u^T x + b with b' = b + u^T m
    bias = bias + _mean_dot(layer, mean, kernel)
  try:
    stored = method.convert(kernel, bias, dtype, use_bias)
  except ValueError as e:
    raise ValueError(f'layer {_name(path)}: {e}') from None
  specs = method.params(kernel.shape, methods.Layer(use_bias=use_bias), lambda: None)
  stored = {k: jnp.asarray(v, methods.base.stored_dtype(specs[k], dtype) if k in specs else dtype)
            for k, v in stored.items()}
  if not imn:
    return stored, None
  shape = tuple(inputs.shape)
  width = math.prod(shape[a] for a in wrappers.contract_axes(layer, len(shape)))
  mean_dtype = jnp.promote_types(inputs.dtype, jnp.float32)
  return stored, jnp.asarray(np.zeros(width) if mean is None else mean, mean_dtype)


def plain_layer(method, layer, stored, kernel_shape, mean, path=(), approximate_borders=False,
                stack: tuple[int, ...] = ()):
  """`(kernel, bias)` numpy float64 of the plain layer from `method`'s stored variables.

  `kernel_shape`: the layer's own (`(*contracted, *features)`); the kernel and bias
  come back in the layer's layout. `mean`: IMN's running mean (None without IMN);
  see `bake` for `approximate_borders`. `stack`: as in `convert_layer` (`stored`,
  `mean` and the result carry these leading axes; `kernel_shape` is one layer's).
  """
  method = methods.get(method)
  pieces = [_plain_one(method, layer, {k: meta.unbox(v)[i] for k, v in stored.items()},
                       kernel_shape, None if mean is None else mean[i],
                       _slice_path(path, i, stack), approximate_borders)
            for i in np.ndindex(stack)]
  kernel, bias = (np.stack([p[j] for p in pieces]).reshape(stack + np.shape(pieces[0][j]))
                  for j in (0, 1))
  return kernel, bias


def _plain_one(method, layer, stored, kernel_shape, mean, path, approximate_borders):
  """`plain_layer` of one layer."""
  shape = wrappers.method_shape(layer, kernel_shape)
  kernel, bias = method.bake(stored, shape)
  kernel = np.asarray(kernel, np.float64).reshape(shape)
  bias = np.zeros(shape[-1]) if bias is None else np.asarray(bias, np.float64)
  if mean is not None and np.any(mean != 0):
    if not _padding_free(layer) and not approximate_borders:
      raise ValueError(
          f'layer {_name(path)}: a conv that pads zeros with a nonzero IMN running mean has no '
          'exact plain form (conv(x - m) differs from conv(x) - w^T m at the borders); pass '
          'approximate_borders=True to fold the mean anyway.')
    bias = bias - _mean_dot(layer, mean, kernel)
  return run.layer_layout(kernel, bias, wrappers.feature_shape(layer))


def bake(rp: Reparameterized, variables, *args, approximate_borders: bool = False, **kwargs):
  """Plain variables of `rp.module` with the same evaluation outputs as `rp` with `variables`.

  `*args, **kwargs` are example inputs of the plain model (shapes are traced,
  nothing runs). Dropped BatchNorm layers come back as the identity (mean 0,
  variance 1, scale `sqrt(1 + epsilon)`, bias 0). IMN's running mean is folded
  into the bias; for zero-padded convs that is exact only away from the
  borders, so it raises unless `approximate_borders=True`.
  """
  method = rp.get_method()
  layers, norms = _record(rp, None, args, kwargs, abstract=True)
  shapes = jax.eval_shape(lambda: meta.unbox(rp.module.init(jax.random.key(0), *args, **kwargs)))
  dropped = _dropped(rp, layers, norms)
  new = _unfrozen(variables)
  biases = {}  # layers without a bias of their own: their bias goes to the dropped BatchNorm
  given = ("pass the variables to_reparameterized or training returned, with their params and "
           f"batch_stats (these have {_collections(variables)})")
  for path, call in layers.items():
    layer = call.layer
    stack = _stacked(_get(shapes['params'], path)['kernel'].shape, call, path)
    kernel_shape = tuple(_get(shapes['params'], path)['kernel'].shape)[len(stack):]
    stored = _lookup(variables, 'params', path)
    names = sorted(method.params(kernel_shape, methods.Layer(
        use_bias=getattr(layer, 'use_bias', True)), lambda: None))
    if not isinstance(stored, Mapping) or not set(names) <= set(stored):
      held = sorted(stored) if isinstance(stored, Mapping) else None
      raise ValueError(
          f'bake: the variables lack params/{_name(path)} of layer {_name(path)} '
          f'({method.name}\'s {names}' + (f'; they hold {held}' if held else '') + '): '
          + (f"these are the plain model's; " if held and 'kernel' in held else '') + given + '.')
    mean = None
    if method.imn is not None:
      mean = _lookup(variables, 'batch_stats', path + ('input_mean_norm', 'mean'))
      if mean is None:
        raise ValueError(
            f"bake: the variables lack IMN's running mean batch_stats/{_name(path)}/"
            f'input_mean_norm/mean for layer {_name(path)} ({method.name!r} has IMN): {given}.')
      mean = np.asarray(mean, np.float64)
      _pop(new['batch_stats'], path + ('input_mean_norm',))
    kernel, bias = plain_layer(method, layer, stored, kernel_shape, mean, path,
                               approximate_borders, stack)
    dtype = _get(shapes['params'], path)['kernel'].dtype
    plain = {'kernel': jnp.asarray(kernel, dtype)}
    if getattr(layer, 'use_bias', True):
      plain['bias'] = jnp.asarray(bias, dtype)
    else:
      biases[path] = bias
    _put(new['params'], path, plain)
  for layer_path, bn_path in dropped.items():
    bn = norms[bn_path].layer
    stats = _get(shapes['batch_stats'], bn_path)['mean']
    features, dtype = stats.shape, stats.dtype
    _put(new.setdefault('batch_stats', {}), bn_path,
         {'mean': jnp.zeros(features, dtype), 'var': jnp.ones(features, dtype)})
    affine = {}
    if bn.use_scale:
      affine['scale'] = jnp.full(features, math.sqrt(1.0 + bn.epsilon), dtype)
    if bn.use_bias:  # takes the bias of a layer that has none
      affine['bias'] = jnp.asarray(biases.pop(layer_path, np.zeros(features)), dtype)
    if affine:
      _put(new['params'], bn_path, affine)
  if not new.get('batch_stats', True) and 'batch_stats' not in shapes:
    del new['batch_stats']  # IMN's running means were all there was
  for layer_path, bias in biases.items():
    if np.any(bias != 0):
      raise ValueError(f'layer {_name(layer_path)} has use_bias=False in the plain model (and '
                       'no dropped BatchNorm after it to carry a bias), but its reparameterized '
                       'form has a nonzero bias: no plain weights match.')
  return new
