"""Parameterizations as records of pure functions, and the one registry of their names.

A method (`Method`, `geoparam.methods.base`) says everything any consumer needs:
the variables it stores for a kernel shape, the `(kernel, bias)` they stand for,
exact conversion of a plain `(kernel, bias)` and back. The linen wrapper
(`geoparam.Reparam`), the paper-form layers, the NNX modules, both whole-model
transforms and the studies read it. IMN composes with any method (`with_imn`).

    >>> from geoparam import methods
    >>> sorted(methods.REGISTRY)
    ['cwn', 'gmp', 'gmp_imn', 'lcw', 'wn']
    >>> m = methods.get('gmp_imn', momentum=0.9)
    >>> m.name, m.imn.momentum
    ('gmp_imn', 0.9)

A new method is a factory returning a `Method` and one `register` call.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import inspect
from typing import Any

from geoparam.methods import base
from geoparam.methods import cwn as _cwn
from geoparam.methods import gmp as _gmp
from geoparam.methods import lcw as _lcw
from geoparam.methods import wn as _wn
from geoparam.methods.base import IMN
from geoparam.methods.base import Layer
from geoparam.methods.base import Method
from geoparam.methods.base import Param
from geoparam.methods.base import init
from geoparam.methods.base import with_imn

__all__ = ['Method', 'Param', 'Layer', 'IMN', 'REGISTRY', 'WRAPPERS', 'PAPER_FORMS', 'register',
           'get', 'build', 'options_of',
           'with_imn', 'init', 'base']

# Method name -> factory(**options) -> Method. The one list of method names.
REGISTRY: dict[str, Callable[..., Method]] = {}
# The named classes of both shells, name -> the factory whose options are the class's fields.
# WRAPPERS wrap any layer (`geoparam.GmP(layer, input_mean_norm=True)`, `geoparam.nnx.CWN`);
# PAPER_FORMS are a Flax layer with these fields too (`geoparam.GmPDense`, `nnx.LCWLinear`).
WRAPPERS = {'GmP': _gmp.switched, 'LCW': _lcw.lcw, 'CWN': _cwn.cwn, 'WN': _wn.wn}
PAPER_FORMS = {'GmP': _gmp.paper, 'LCW': _lcw.lcw, 'CWN': _cwn.cwn}


def register(name: str, factory: Callable[..., Method], *, override: bool = False) -> None:
  """Makes `factory(**options) -> Method` available as `name` to every consumer.

  A name already registered (a built-in such as `'gmp'` included) is refused unless
  `override=True`: replacing it changes that method for every layer, wrapper and transform in
  the process. Registering the same factory again under its name is a no-op.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f'a method name must be a non-empty string, got {name!r}.')
  if not callable(factory):
    raise TypeError(f'factory must be callable, got {factory!r}.')
  if name in REGISTRY and REGISTRY[name] is not factory and not override:
    raise ValueError(f'method {name!r} is already registered (to {_named(REGISTRY[name])}); '
                     'registering it again would replace it for every consumer in the process. '
                     'Pick a new name, or pass override=True to replace it.')
  REGISTRY[name] = factory


def _named(factory) -> str:
  """`module.qualname` of a factory, for messages (its repr when it has none)."""
  qualname = getattr(factory, '__qualname__', None)
  return f'{getattr(factory, "__module__", "?")}.{qualname}' if qualname else repr(factory)


@functools.cache
def options_of(factory: Callable[..., Method]) -> dict[str, Any]:
  """`{option: default}` of a factory (its named parameters, in order; `inspect.Parameter.empty`
  where one has no default): the fields of the shells' named classes built on it. Cached (the
  layers read it at every call): do not change the dict.

    >>> options_of(WRAPPERS['CWN'])
    {'scale_init': <function ones at ...>, 'epsilon': 1e-12}
  """
  return {p.name: p.default for p in inspect.signature(factory).parameters.values()
          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def build(factory: Callable[..., Method], options: dict[str, Any], owner: str):
  """`factory(**options)`; options it does not take raise a TypeError naming `owner` (the method
  or the class built on it) and listing those it takes.

    >>> build(WRAPPERS['WN'], {'eps': 0.1}, 'WN')
    Traceback (most recent call last):
    TypeError: WN takes the options ['epsilon', 'scale_init']; got unknown ['eps'].
  """
  accepted = sorted(options_of(factory))
  unknown = sorted(set(options) - set(accepted))
  if unknown:
    raise TypeError(f'{owner} takes the options {accepted}; got unknown {unknown}.')
  return factory(**options)


def get(method: str | Method, **options) -> Method:
  """The `Method` for a registry name (built with `options`), or `method` itself.

  Raises ValueError for an unknown name (listing the registered ones), and TypeError for a
  `method` that is neither a name nor a `Method`, for options the method does not take and
  for a registered factory that returns no `Method`.
  """
  if isinstance(method, Method):
    if options:
      raise TypeError(f'options {sorted(options)} are given with a built Method '
                      f'({method.name!r}): build it with them instead.')
    return method
  if not isinstance(method, str):
    raise TypeError(f'method must be a registry name (one of {tuple(REGISTRY)}) or a '
                    f'geoparam.methods.Method, got {method!r} of type {type(method).__name__}.')
  if method not in REGISTRY:
    raise ValueError(f'method must be one of {tuple(REGISTRY)} or a geoparam.methods.Method, '
                     f'got {method!r}.')
  factory = REGISTRY[method]
  built = build(factory, options, f'method {method!r}')
  if not isinstance(built, Method):
    raise TypeError(f'the factory registered as method {method!r} ({_named(factory)}) returned '
                    f'{built!r:.80} of type {type(built).__name__}, not a geoparam.methods.Method.')
  return built


register('gmp', _gmp.gmp)
register('gmp_imn', _gmp.gmp_imn)
register('lcw', _lcw.lcw)
register('cwn', _cwn.cwn)
register('wn', _wn.wn)
