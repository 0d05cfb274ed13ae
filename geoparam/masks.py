"""Optimizer labels and weight-decay masks of a parameter pytree (linen `params` or an NNX
`nnx.State`), for `optax.partition` and `optax.add_decayed_weights(mask=...)` / `optax.masked`.

`param_groups` labels every leaf by the role it plays: a reparameterized layer's variables
by their method's record (`'direction'`, `'scale'`, `'bias'`, `'fixed'`), a plain layer's as
`'weight'`, `'bias'` or `'norm'`; `'other'` for the rest. One rate per group:

    >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, geoparam
    >>> model = nn.Sequential([geoparam.GmP(nn.Dense(4)), nn.relu, nn.Dense(2)])
    >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))['params']
    >>> geoparam.param_groups(params)
    {'layers_0': {'lam': 'bias', 'scale': 'scale', 'theta': 'direction'}, 'layers_2': {'bias': 'bias', 'kernel': 'weight'}}
    >>> tx = optax.partition({'direction': optax.sgd(0.1), 'scale': optax.sgd(0.01),
    ...                       'bias': optax.sgd(0.1), 'weight': optax.sgd(0.1)},
    ...                      geoparam.param_groups)
    >>> state = tx.init(params)

`decay_mask` decides by the parameter's leaf name, the last key of its path:

* decayed: weight tensors, i.e. `kernel` (Dense/Conv, and the direction of
  flax's WN) and `v` (LCW coordinates; `|B v| = |v|`, so decaying `v` is the
  same L2 penalty as decaying the kernel);
* NOT decayed: everything else, in particular PReLU `negative_slope` (paper
  001: decay biases it towards ReLU), biases, norm `scale`/`bias`, WN/CWN
  gains, and the GmP parameters `theta` (angles: an L2 penalty on angles pulls
  directions towards the first axis, which has no meaning) and `lam`, `scale`.

Note for GmP: SP's decay `|w|^2` equals `scale^2` there (`|w| = r`); to get it,
pass `decayed_names=('kernel', 'v', 'scale')`, which also decays norm-layer
scales, or build your own predicate with `decay_mask_by`, or decay by group.

Paths are read as names: dict keys, attribute names and indices; the `.value` an NNX
`Variable` (or a linen partitioning box) ends a path with is not a name.
"""

from __future__ import annotations

from typing import Any, Callable, Collection

import jax

from geoparam import methods

__all__ = ['GROUPS', 'DECAYED_NAMES', 'param_groups', 'decay_mask', 'decay_mask_by']

#: The labels of `param_groups`: the method roles (`geoparam.methods.ROLES`), then the plain ones.
GROUPS = methods.base.ROLES + ('weight', 'norm', 'other')

DECAYED_NAMES = ('kernel', 'v')


def _names(path) -> tuple[str, ...]:
  """The names of a pytree path: dict keys, attribute names and indices, without the `value`
  attribute an NNX Variable or a partitioning box holds its array under."""
  keys = list(path)
  while keys and isinstance(keys[-1], jax.tree_util.GetAttrKey):
    keys.pop()  # Variable.value, nn.Partitioned.value
  return tuple(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in keys)


def _map_names(params: Any, fn: Callable[[tuple[str, ...], Any], Any]) -> Any:
  """`params` with every leaf replaced by `fn(path names, leaf)`."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  return jax.tree_util.tree_unflatten(treedef, [fn(_names(p), x) for p, x in leaves])


def _method_roles() -> dict[frozenset, dict[str, str]]:
  """`{variable names: {name: role}}` of every registered method's layers (with and without a
  bias, fan-in 1 and more), from the records."""
  out = {}
  for name in methods.REGISTRY:
    method = methods.get(name)
    for shape in ((1, 2), (3, 2)):
      for use_bias in (True, False):
        if shape[0] >= method.min_fan_in:
          specs = method.params(shape, methods.Layer(use_bias=use_bias), lambda: None)
          out.setdefault(frozenset(specs), {k: p.role for k, p in specs.items()})
  return out


def _plain_role(name: str, siblings: frozenset, leaf) -> str:
  if name in ('kernel', 'embedding'):
    return 'weight'
  if 'scale' in siblings and 'kernel' not in siblings:  # LayerNorm, BatchNorm, RMSNorm, ...
    return 'norm'
  if name == 'bias':
    return 'bias'
  return 'weight' if len(getattr(leaf, 'shape', ())) >= 2 else 'other'


def param_groups(params: Any) -> Any:
  """A label (one of `GROUPS`) for every leaf of `params`, in a pytree of its structure.

  A layer (the leaves sharing a parent) whose variable names are those a registered method
  stores (`geoparam.methods.REGISTRY`: GmP's `theta`, `lam`, `scale`; LCW's `v`, `bias`;
  WN's and CWN's `kernel`, `scale`, `bias`) gets its record's roles: `'direction'`,
  `'scale'`, `'bias'`, `'fixed'`. Other leaves: `kernel` and `embedding` are `'weight'`;
  the leaves of a layer with a `scale` and no `kernel` (a norm layer) `'norm'`; `bias`
  `'bias'`; any other leaf of rank >= 2 `'weight'`, the rest `'other'` (PReLU's slope). A
  plain layer's `{kernel, bias}` stays plain even where a custom method stores those names.

  `params`: linen `variables['params']` or an NNX `nnx.State` (`nnx.state(model, nnx.Param)`);
  usable directly as `optax.partition`'s labels function (and so in `nnx.Optimizer`).

    >>> import numpy as np
    >>> param_groups({'hidden': {'theta': np.zeros((2, 4)), 'lam': np.zeros(4),
    ...                          'scale': np.ones(4)},
    ...               'norm': {'scale': np.ones(4), 'bias': np.zeros(4)},
    ...               'head': {'kernel': np.zeros((4, 2)), 'bias': np.zeros(2)}})
    {'head': {'bias': 'bias', 'kernel': 'weight'}, 'hidden': {'lam': 'bias', 'scale': 'scale', 'theta': 'direction'}, 'norm': {'bias': 'norm', 'scale': 'norm'}}
  """
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  siblings = {}
  for path, _ in leaves:
    names = _names(path)
    siblings.setdefault(names[:-1], set()).add(names[-1] if names else '')
  roles = _method_roles()

  def label(names, leaf):
    layer = frozenset(siblings[names[:-1]])
    if layer in roles and layer not in (frozenset({'kernel', 'bias'}), frozenset({'kernel'})):
      return roles[layer][names[-1]]
    return _plain_role(names[-1] if names else '', layer, leaf)

  return _map_names(params, label)


def decay_mask_by(params: Any, predicate: Callable[[tuple[str, ...], Any], bool]) -> Any:
  """Bool pytree like `params`: `predicate(path_names, leaf)` per leaf.

  `path_names` is the tuple of string keys from the root, e.g.
  `('Dense_0', 'kernel')` (an NNX Variable's `.value` is not one).
  """
  return _map_names(params, lambda names, leaf: bool(predicate(names, leaf)))


def decay_mask(params: Any, decayed_names: Collection[str] = DECAYED_NAMES) -> Any:
  """Bool pytree like `params`, True where weight decay applies.

  Usable directly as a mask function:
  `optax.add_decayed_weights(1e-4, mask=decay_mask)`.

  Args:
    params: a parameter pytree (nested dicts / FrozenDicts of arrays).
    decayed_names: leaf names that are decayed; all others are not.
  """
  if isinstance(decayed_names, str):
    raise ValueError(
        f'decay_mask needs a collection of names for decayed_names, got the string '
        f'{decayed_names!r}; write ({decayed_names!r},).')
  decayed = frozenset(decayed_names)
  return decay_mask_by(params, lambda names, _: bool(names) and names[-1] in decayed)
