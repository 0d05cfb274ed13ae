"""Weight-decay masks for `optax.add_decayed_weights(mask=...)` / `optax.masked`.

Decision (by the parameter's leaf name, the last key of its path):

* decayed: weight tensors, i.e. `kernel` (Dense/Conv, and the direction of
  flax's WN) and `v` (LCW coordinates; `|B v| = |v|`, so decaying `v` is the
  same L2 penalty as decaying the kernel);
* NOT decayed: everything else, in particular PReLU `negative_slope` (paper
  001: decay biases it towards ReLU), biases, norm `scale`/`bias`, WN/CWN
  gains, and the GmP parameters `theta` (angles: an L2 penalty on angles pulls
  directions towards the first axis, which has no meaning) and `lam`, `scale`.

Note for GmP: SP's decay `|w|^2` equals `scale^2` there (`|w| = r`); to get it,
pass `decayed_names=('kernel', 'v', 'scale')`, which also decays norm-layer
scales, or build your own predicate with `decay_mask_by`.
"""

from __future__ import annotations

from typing import Any, Callable, Collection

import jax

__all__ = ['DECAYED_NAMES', 'decay_mask', 'decay_mask_by']

DECAYED_NAMES = ('kernel', 'v')


def _key_name(key) -> str:
  """The name of one path entry (a dict key, an attribute name or a sequence index)."""
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def decay_mask_by(params: Any, predicate: Callable[[tuple[str, ...], Any], bool]) -> Any:
  """Bool pytree like `params`: `predicate(path_names, leaf)` per leaf.

  `path_names` is the tuple of string keys from the root, e.g.
  `('Dense_0', 'kernel')`.
  """
  def f(path, leaf):
    names = tuple(_key_name(k) for k in path)
    return bool(predicate(names, leaf))

  return jax.tree_util.tree_map_with_path(f, params)


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
