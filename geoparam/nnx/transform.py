"""Reparameterize an NNX model in place, exactly, and bake it back.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import geoparam.nnx as gnnx
    >>> class MLP(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.hidden = nnx.Linear(3, 8, rngs=rngs)
    ...     self.head = nnx.Linear(8, 2, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.head(nnx.relu(self.hidden(x)))
    >>> model = MLP(nnx.Rngs(0))
    >>> x = jnp.ones((4, 3))
    >>> before = model(x)
    >>> model = gnnx.reparameterize(model, 'gmp', exclude=['head'])
    >>> type(model.hidden).__name__, model.hidden.theta.shape
    ('Reparam[Linear]', (2, 8))
    >>> bool(jnp.allclose(model(x), before, atol=1e-5))
    True
    >>> model = gnnx.bake(model)
    >>> type(model.hidden).__name__, bool(jnp.allclose(model(x), before, atol=1e-5))
    ('Linear', True)

The conversion is `geoparam.exact.convert_layer`, the linen transform's too:
BatchNorm folding, IMN calibration and the exactness checks are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
import functools
from typing import Any

from flax import nnx

from geoparam import checks
from geoparam import exact
from geoparam import kinds
from geoparam import methods
from geoparam import selection
from geoparam.nnx import modules
from geoparam.selection import name as _name

__all__ = ['DroppedBatchNorm', 'reparameterize', 'bake']

Where = Callable[[nnx.Module, tuple[str, ...]], bool]
_BN_FIELDS = ('epsilon', 'use_scale', 'use_bias', 'param_dtype')  # what bake rebuilds one with


class DroppedBatchNorm(nnx.Module):
  """The identity where `reparameterize(..., drop_batchnorm=True)` removed an `nnx.BatchNorm`.

  Keeps what `bake` needs to put a BatchNorm back (as the identity, carrying the
  bias of a preceding layer that has none): `num_features`, `epsilon`,
  `use_scale`, `use_bias`, `param_dtype` and the producing layer's path.
  """

  def __init__(self, bn: nnx.BatchNorm, producer: tuple[Any, ...]):
    for field in ('num_features',) + _BN_FIELDS:
      setattr(self, field, getattr(bn, field))
    self.stats_dtype = bn.mean[...].dtype
    self.stack = tuple(bn.mean.shape[:-1])  # stacked by nnx.vmap
    self.producer = tuple(producer)

  def __call__(self, x, *args, **kwargs):
    """Returns `x` (any BatchNorm call arguments are accepted and ignored)."""
    del args, kwargs
    return x


def _replace(nodes, path, new):
  """Puts `new` at `path` of the graph (`nodes`: its `nnx.iter_graph` by path): an attribute of
  a Module, or an item of a List/dict."""
  parent, key = nodes[path[:-1]], path[-1]
  if isinstance(parent, nnx.Module) and isinstance(key, str) and not isinstance(parent, nnx.List):
    setattr(parent, key, new)
  else:
    parent[key] = new


_LOGS: dict[int, dict] = {}  # by a token: NNX transforms (nnx.scan) rebuild modules from copies


def _probe_call(self, x, *args, **kwargs):
  """A probed layer's `__call__`: its own, then its first call's `(inputs, output)` recorded
  into `_LOGS[token][path]`."""
  y = type(self)._probed.__call__(self, x, *args, **kwargs)  # pylint: disable=protected-access
  path, token = self._geoparam_probe  # pylint: disable=protected-access
  _LOGS[token].setdefault(path, (x, y))
  return y


@functools.cache
def _probe_class(cls: type) -> type:
  """`cls` with a recording `__call__` (a subclass, made once per class)."""
  return type(f'_Probe[{cls.__name__}]', (cls,), dict(__call__=_probe_call, _probed=cls,
                                                        __module__=__name__))


def _record(model, paths, example_args):
  """Runs an eval-mode copy of `model` on `example_args`; `{path: (inputs, output)}`.

  Each recorded layer of the copy becomes a subclass of its own class whose `__call__` also
  records, so the model's code sees the same layers (type, fields, `kernel`). Inside
  `nnx.scan`/`nnx.vmap` the inputs and outputs are the trace's (shapes, and the identity that
  pairs a layer with the BatchNorm it feeds, are what is read of them).
  """
  probe = nnx.clone(model)
  probe.eval()
  token = id(probe)
  log = _LOGS[token] = {}
  try:
    nodes = dict(nnx.iter_graph(probe))
    for path in paths:
      node = nodes[path]
      object.__setattr__(node, '__class__', _probe_class(type(node)))
      node._geoparam_probe = (tuple(path), token)  # pylint: disable=protected-access
    probe(*example_args)
  finally:
    del _LOGS[token]
  return log


def _others(shared, path) -> list[tuple]:
  """The other paths that reach the module or variable at `path`, itself shared or inside a
  shared module (`shared`: `{path: all its node's paths}` of `nnx.find_duplicates`)."""
  return [other + path[n:] for n in range(len(path) + 1) for other in shared.get(path[:n], ())
          if other != path[:n]]


def reparameterize(model: nnx.Module, method: str | methods.Method, *example_args,
                   where: Where | None = None, exclude: Iterable[str] = (),
                   drop_batchnorm: bool = False, use_running_average: bool | None = None,
                   **options):
  """Replaces `model`'s kernel layers (`geoparam.kinds`) by `method`'s wrapper, in place, exactly.

  Each selected layer becomes `geoparam.nnx.Reparam(layer, method)` holding that
  layer's current weights converted exactly, so the model's evaluation outputs
  do not change (float rounding aside). LinearGeneral layers with several output
  axes (`nnx.MultiHeadAttention`'s q/k/v/out) are converted like the others (a
  unit is one output). `nnx.Einsum` (Gemma's projections) and `nnx.ConvTranspose`
  layers convert too; IMN where it has no exact form raises, naming the layer, before any
  change. Under `nnx.eval_shape` it gives the abstract model (a checkpoint's restore
  target), under `nnx.jit` the same conversion (`geoparam.exact.convert_layer`).

  Args:
    model: any NNX module (changed in place and returned).
    method: a name in `geoparam.methods.REGISTRY` (`'gmp'`, `'gmp_imn'`, `'lcw'`,
      `'cwn'`, `'wn'`, ...) or a `geoparam.methods.Method`.
    *example_args: an example batch for `model(*example_args)`; needed for
      `drop_batchnorm` (to see which layer feeds each BatchNorm) and to start
      IMN's running mean at the batch mean (else it starts at 0, also exact).
    where: optional `where(layer, path) -> bool` (path: tuple of str).
    exclude: names or '/'-joined paths kept plain, e.g. `['head']`.
    drop_batchnorm: fold each selected `nnx.BatchNorm` (evaluation statistics)
      into the layer feeding it and replace it by `DroppedBatchNorm` (identity).
    use_running_average: the new wrappers' train/eval mode (IMN); None takes the
      model's: that of its first module with this attribute (e.g. a BatchNorm),
      else True (evaluation). `model.train()`/`model.eval()` switch it later.
    **options: the method's options (`momentum`, `axis_name`, `epsilon`, ...).

  Returns:
    `model` (a model that is itself one layer: its wrapper, so use the return value). Raises
    ValueError naming the layer when no exact form exists (see
    `geoparam.linen.transform.to_reparameterized`).
  """
  method = methods.get(method, **options)  # unknown methods and options fail before any change
  if not isinstance(model, nnx.Module):
    hint = ('pass an instance' if isinstance(model, type) else
            'for a linen model use geoparam.reparameterize' if hasattr(model, 'scope') else
            'pass the NNX module itself')
    raise TypeError(f'geoparam.nnx.reparameterize takes an nnx.Module instance, got '
                    f'{model!r:.80} ({type(model).__name__}): {hint}.')
  exclude = selection.check_arguments(where, exclude, drop_batchnorm, use_running_average,
                                       method)
  nodes = dict(nnx.iter_graph(model))
  seen = [p for p, n in nodes.items() if kinds.of(n) is not None or isinstance(n, nnx.BatchNorm)]
  layers, norms = {}, {}  # the selected kernel layers and (drop_batchnorm) BatchNorms
  for path, node in nodes.items():
    kind = kinds.of(node)
    norm = drop_batchnorm and isinstance(node, nnx.BatchNorm)
    if (kind is None and not norm) or not selection.selected(node, path, where, exclude):
      continue
    if kind is not None and kind.refused:
      raise selection.refused(node, path, 'nnx')
    (layers if kind is not None else norms)[path] = node
  selection.check_selection(type(model).__name__, method.name, seen, list(layers), where,
                            exclude, 'holds')
  shared = {p: paths for paths in nnx.find_duplicates(model) for p in paths}
  for path, node in {**layers, **norms}.items():
    if _others(shared, path):
      raise ValueError(
          f'{type(node).__name__} at {_name(path)} is shared (also at '
          f'{", ".join(_name(p) for p in _others(shared, path))}): replacing it in one '
          'place would leave the other plain; exclude it, or give each place its own layer.')
  for path, node in layers.items():  # a tie through one nnx.Param: converted apart, it would untie
    kind = kinds.of(node)
    for attr in (kind.kernel, kind.bias):
      others = _others(shared, path + (attr,))
      if others:
        raise ValueError(
            f'the {attr} of {type(node).__name__} at {_name(path)} is tied: the same '
            f'{type(getattr(node, attr)).__name__} is also at '
            f'{", ".join(_name(p) for p in others)}. Converted apart, the tie would come undone '
            '(each layer its own method variables); exclude the tied layers, or untie them (and '
            'tie again after bake).')
  if norms and not example_args:
    raise ValueError('drop_batchnorm=True needs an example batch (reparameterize(model, method, '
                     'x, ...)) to find the layer that feeds each BatchNorm.')
  if use_running_average is None:
    use_running_average = next((n.use_running_average for n in nodes.values() if isinstance(
        n, nnx.Module) and getattr(n, 'use_running_average', None) is not None), True)
  calls = _record(model, list(layers) + list(norms), example_args) if example_args else {}
  layouts = {p: modules.layout_of(n, p) for p, n in layers.items()}
  folds, dropped = {}, {}
  outputs = {p: calls[p][1] for p in layers if p in calls}
  for bn_path, bn in norms.items():
    if bn_path not in calls:
      raise ValueError(f'BatchNorm {_name(bn_path)} did not run on the example batch, so the '
                       'layer that feeds it is unknown and it cannot be dropped (exclude it, or '
                       'give an example that runs it).')
    producer = exact.fed_layer(bn_path, calls[bn_path][0], outputs, layouts.get, bn.axis,
                               (bn.num_features,))
    folds[producer] = exact.bn_affine(
        bn.mean[...], bn.var[...], bn.epsilon, bn.scale[...] if bn.use_scale else None,
        bn.bias[...] if bn.use_bias else None)
    dropped[bn_path] = DroppedBatchNorm(bn, producer)
  converted = {p: modules.converted(n, method, calls.get(p, (None,))[0], p, folds.get(p),
                                    use_running_average=use_running_average, layout=layouts[p])
               for p, n in layers.items()}  # inputs None: a layer that did not run
  if () in converted:  # the model is the layer itself: its wrapper is the new model
    return converted[()]
  for path, new in {**converted, **dropped}.items():
    _replace(nodes, path, new)
  return model


def bake(model: nnx.Module, *, approximate_borders: bool = False):
  """Turns every geoparam NNX wrapper in `model` back into its plain layer, in place.

  The plain layers compute the same function in evaluation mode (IMN's running
  mean folded into the bias; for zero-padded convs with a nonzero running mean
  that is exact only away from the borders: raises unless
  `approximate_borders=True`). Each `DroppedBatchNorm` becomes an
  `nnx.BatchNorm` that is the identity in evaluation mode (mean 0, var 1,
  scale `sqrt(1 + epsilon)`), carrying the bias of a bias-less layer before it.

  Returns:
    `model`, changed in place (a model that is itself one wrapper: its plain
    layer, so use the return value).
  """
  if not isinstance(model, nnx.Module):
    hint = ('for a linen model use geoparam.bake(rp, variables, *inputs)' if hasattr(model, 'scope')
            else 'pass the NNX module that geoparam.nnx.reparameterize returned')
    raise TypeError(f'geoparam.nnx.bake takes an nnx.Module, got a {type(model).__name__}: '
                    f'{hint}.')
  checks.flag('approximate_borders', approximate_borders, 'bake')
  nodes = dict(nnx.iter_graph(model))
  producers = {n.producer for n in nodes.values() if isinstance(n, DroppedBatchNorm)}
  plain, biases = {}, {}
  for path, node in nodes.items():
    if isinstance(node, modules.Reparam) and not node.scale_outside:
      plain[path], bias = node.plain_layer(approximate_borders=approximate_borders,
                                           carry_bias=path in producers, path=path)
      if not node.layer_has_bias:
        biases[path] = bias
  for path, node in nodes.items():
    if isinstance(node, DroppedBatchNorm):
      bn = nnx.BatchNorm(node.num_features, **{f: getattr(node, f) for f in _BN_FIELDS},
                         use_running_average=True, rngs=nnx.Rngs(0))
      stats, affine = exact.identity_batchnorm(  # carrying the bias of a layer that has none
          node.stack + (node.num_features,), node.epsilon, node.use_scale, node.use_bias,
          node.stats_dtype, node.param_dtype, biases.pop(node.producer, 0.0), node.producer, path)
      for name, value in {**stats, **affine}.items():
        getattr(bn, name).set_value(value)
      plain[path] = bn
  if not plain:
    raise ValueError(
        f'geoparam.nnx.bake: {type(model).__name__} holds no reparameterized layer (and no '
        'dropped BatchNorm), so there is nothing to bake (paper-form layers such as GmPLinear '
        'have no plain form and stay). Pass the model that geoparam.nnx.reparameterize '
        'returned.')
  if () in plain:  # the model is one wrapper: its plain layer is the new model
    return plain[()]
  for path, new in plain.items():
    _replace(nodes, path, new)
  return model
