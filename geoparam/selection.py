"""Which layers a whole-model transform reparameterizes: the rules both shells share.

A layer is selected unless an `exclude` entry names it (its name or its
'/'-joined path) or `where(layer, path)` says no. A selection that changes
nothing is an error, never a silent no-op: no layer selected, or an `exclude`
entry that names no layer (a typo would reparameterize the layer it meant to keep).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from geoparam import checks
from geoparam import kinds

__all__ = ['name', 'excluded', 'selected', 'check_selection', 'refused', 'check_arguments']


def name(path) -> str:
  """`'a/b'` for a path, `'<root>'` for the empty one."""
  return '/'.join(str(p) for p in path) or '<root>'


def excluded(path: tuple, exclude) -> bool:
  """Whether an `exclude` entry names the layer at `path`: its name, or its '/'-joined path.

    >>> excluded(('blocks', 'head'), ['head']), excluded(('blocks', 'head'), ['blocks/head'])
    (True, True)
    >>> excluded(('blocks', 'head'), ['blocks'])
    False
  """
  names = tuple(str(p) for p in path)
  return '/'.join(names) in exclude or bool(names and names[-1] in exclude)


def check_arguments(where, exclude, drop_batchnorm, use_running_average=None,
                    method=None) -> tuple[str, ...]:
  """Checks a whole-model transform's selection arguments (both shells); returns `exclude` as a
  tuple of names. Raises a TypeError naming the bad one.

    >>> check_arguments(None, 'head', False)
    ('head',)
  """
  names = (exclude,) if isinstance(exclude, str) else exclude
  names = tuple(names) if isinstance(names, Iterable) else (None,)
  if not all(isinstance(e, str) for e in names):
    raise TypeError(f'exclude must be layer names or \'/\'-joined paths (strings), e.g. '
                    f"exclude=['head'], got {exclude!r:.60}.")
  checks.function('where', where, 'a function where(layer, path) -> bool (or None: every layer; '
                  'exclude=[...] keeps layers plain by name)', optional=True)
  checks.flag('drop_batchnorm', drop_batchnorm)
  checks.flag('use_running_average', use_running_average, optional=True)
  if use_running_average is not None and method is not None and method.imn is None:
    raise ValueError(f'use_running_average={use_running_average} switches IMN\'s running mean, '
                     f'but method {method.name!r} has no IMN: leave it out (or use a method with '
                     "IMN, e.g. 'gmp_imn').")
  return names


def selected(layer, path, where: Callable | None, exclude) -> bool:
  """Whether the layer at `path` is selected by `where` and `exclude`."""
  if excluded(path, exclude):
    return False
  if where is None:
    return True
  try:
    chosen = where(layer, tuple(str(p) for p in path))
  except TypeError as e:
    if 'positional argument' in str(e):
      raise TypeError(f'where must take (layer, path) and return a bool; calling it with the '
                      f'layer at {name(path)!r} failed: {e}') from None
    raise
  try:
    return bool(chosen)
  except (TypeError, ValueError) as e:
    raise TypeError(f'where must return a bool; for the layer at {name(path)!r} it returned '
                    f'{chosen!r:.60} ({e})') from None


def refused(layer, path, framework: str = 'nn') -> ValueError:
  """The error for a selected layer of a kind that cannot be reparameterized."""
  shown = name(path)
  return ValueError(
      f'layer {shown!r} is an {framework}.{type(layer).__name__}, which geoparam cannot '
      f'reparameterize ({kinds.of(layer).refused}), and the selection picks it. Keep it plain: '
      f'exclude=[{str(path[-1]) if path else shown!r}] (or its \'/\'-joined path), or a where= '
      'that leaves it out.')


def check_selection(model: str, method: str, seen, chosen, where, exclude, verb: str = 'ran'
                    ) -> None:
  """Raises where the selection is a silent no-op: no layer selected, or an `exclude` entry
  that names no layer.

  `model`, `method`: names for the message; `seen`: the paths of the model's
  candidate layers (every registered kind and BatchNorm; what the model `verb`,
  'ran' or 'holds'); `chosen`: those reparameterized.
  """
  layers = sorted({'/'.join(str(k) for k in p) for p in seen})
  shown = ', '.join(layers[:12]) + (f' (and {len(layers) - 12} more)' if len(layers) > 12 else '')
  if not chosen:
    kind_names = sorted({k.name for k in kinds.REGISTRY.values() if not k.refused})
    raise ValueError(
        f'reparameterize({model}, {method!r}): no layer was selected ({", ".join(kind_names)}; '
        f'where={where!r}, exclude={list(exclude)}); the model {verb} {shown or "none"}. A '
        'selection that matches nothing leaves the model plain. A layer class of your own is '
        'a candidate once registered: geoparam.kinds.register(geoparam.kinds.Kind(...), '
        'MyLayer).')
  unmatched = [e for e in exclude if not any(excluded(p, (e,)) for p in seen)]
  if unmatched:
    raise ValueError(f'reparameterize({model}): exclude entries {unmatched} name no layer the '
                     f'model {verb} ({shown}); check the names (a layer name or a \'/\'-joined '
                     'path).')
