"""The scalar argument checks of the public entry points, in one place.

Each check raises naming the argument (and its owner, `'owner: name ...'`, where
given) and what it accepts: a number of the wrong type an `ArgumentError`, one
out of range a ValueError, a flag that is no bool a TypeError. The public
functions and layers check their arguments once; the pure functions below them
assume checked arguments, as optax's do. This module imports no other geoparam
module.

    >>> from geoparam import checks
    >>> checks.count('patience', 3), checks.real('factor', 0.5, 'in (0, 1)', lambda x: x < 1)
    (3, 0.5)
"""

from __future__ import annotations

from collections.abc import Callable
import math
import operator

import jax.numpy as jnp
import numpy as np

__all__ = ['ArgumentError', 'INT32_MAX', 'flag', 'function', 'count', 'real', 'momentum',
           'one_of', 'real_dtype', 'floating']

INT32_MAX = 2**31 - 1  # a count's largest value (counters are int32)


class ArgumentError(TypeError, ValueError):
  """A number of the wrong type (a str for a real number, a float for a count, ...).

  A TypeError, and a ValueError too: the value is not one the argument accepts,
  so `except ValueError` catches every bad number these checks raise for.
  """


def _owner(owner: str | None) -> str:
  return f'{owner}: ' if owner else ''


def _not_number(value) -> bool:
  """A bool, a str or bytes, or not a scalar: no count or real number."""
  return isinstance(value, (bool, np.bool_, str, bytes)) or np.ndim(value) != 0


def flag(name: str, value, owner: str | None = None, optional: bool = False) -> None:
  """Raises a TypeError unless `value` is True or False (a numpy bool too), or None where
  `optional`.

    >>> flag('approximate_borders', 'yes', 'bake')
    Traceback (most recent call last):
    TypeError: bake: approximate_borders must be True or False, got 'yes'.
  """
  if not (isinstance(value, (bool, np.bool_)) or (optional and value is None)):
    raise TypeError(f'{_owner(owner)}{name} must be {"None, " if optional else ""}True or False, '
                    f'got {value!r}.')


def function(name: str, value, what: str, owner: str | None = None,
             optional: bool = False) -> None:
  """Raises a TypeError unless `value` is callable (or None where `optional`); `what` says how
  it is called.

    >>> function('select', 3, 'a function select(path) -> bool')
    Traceback (most recent call last):
    TypeError: select must be a function select(path) -> bool, got 3 of type int.
  """
  if not (callable(value) or (optional and value is None)):
    raise TypeError(f'{_owner(owner)}{name} must be {what}, got {value!r:.60} of type '
                    f'{type(value).__name__}.')


def count(name: str, value, least: int = 0, owner: str | None = None) -> int:
  """`value` as an int: a Python or NumPy integer in `[least, 2**31 - 1]` (a size, a number of
  epochs); an `ArgumentError` for a bool, float or str, else a ValueError.

    >>> count('every', 2.5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    geoparam.checks.ArgumentError: every must be an int >= 0 (...), got 2.5 of type float.
    >>> count('in_features', 0, 1, 'GmPLinear')
    Traceback (most recent call last):
    ValueError: GmPLinear: in_features must be an integer in [1, 2147483647], got in_features = 0.
  """
  try:
    index = None if _not_number(value) else operator.index(value)
  except TypeError:
    index = None
  if index is None:
    raise ArgumentError(
        f'{_owner(owner)}{name} must be an int >= {least} (a Python or NumPy integer; not bool, '
        f'float or str), got {value!r} of type {type(value).__name__}.')
  if not least <= index <= INT32_MAX:
    raise ValueError(f'{_owner(owner)}{name} must be an integer in [{least}, {INT32_MAX}], got '
                     f'{name} = {index}.')
  return index


def real(name: str, value, accepted: str = '', ok: Callable[[float], bool] = lambda x: True,
         owner: str | None = None) -> float:
  """`value` as a float: a finite real scalar (Python, NumPy or JAX) for which `ok` holds, as
  `accepted` says; an `ArgumentError` for a bool, str, None or complex, else a ValueError.

    >>> real('min_lr', float('nan'), '>= 0', lambda x: x >= 0)
    Traceback (most recent call last):
    ValueError: min_lr must be a finite real number >= 0, got min_lr = nan.
  """
  accepted = f' {accepted}' if accepted else ''
  try:
    number = None if _not_number(value) else float(value)
  except (TypeError, ValueError):
    number = None
  if number is None:
    raise ArgumentError(f'{_owner(owner)}{name} must be a real number{accepted}, got {value!r} '
                        f'of type {type(value).__name__}.')
  if not (math.isfinite(number) and ok(number)):
    raise ValueError(f'{_owner(owner)}{name} must be a finite real number{accepted}, got '
                     f'{name} = {value!r}.')
  return number


def momentum(value, owner: str | None = None) -> float:
  """A running mean's decay: `real` in [0, 1].

    >>> momentum('0.9')
    Traceback (most recent call last):
    geoparam.checks.ArgumentError: momentum must be a real number in [0, 1], got '0.9' of type str.
  """
  return real('momentum', value, 'in [0, 1]', lambda x: 0.0 <= x <= 1.0, owner)


def one_of(name: str, value, choices: tuple, owner: str | None = None) -> None:
  """Raises a ValueError unless `value` is one of `choices`.

    >>> one_of('mode', 'fan_avg', ('fan_in', 'fan_out'))
    Traceback (most recent call last):
    ValueError: mode must be one of ('fan_in', 'fan_out'), got 'fan_avg'.
  """
  if value not in choices:
    raise ValueError(f'{_owner(owner)}{name} must be one of {choices}, got {value!r}.')


def real_dtype(value):
  """The dtype of `value` if it is real numbers (int or float: Python, NumPy or JAX, traced
  too), else None (str, bytes, None, bool, complex, objects). Reads no values: jit-safe.

    >>> real_dtype(1.0), real_dtype('1.0'), real_dtype(True)
    (dtype('float64'), None, None)
  """
  if isinstance(value, (str, bytes, bool, np.bool_)) or value is None:
    return None
  try:
    dtype = value.dtype if hasattr(value, 'dtype') else np.asarray(value).dtype
  except (TypeError, ValueError):
    return None
  return dtype if jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer) else None


def floating(value, name: str, owner: str, complex_ok: bool = False):
  """`value` as an array of a real floating dtype (also complex where `complex_ok`): integers
  and bools become the default float, anything else (PRNG keys, strings, ...) is a TypeError
  naming the dtype (a real map would drop a complex array's imaginary part).

    >>> floating([1, 2], 'w', 'from_cartesian').dtype
    dtype('float...')
    >>> floating([1j], 'w', 'from_cartesian')
    Traceback (most recent call last):
    TypeError: from_cartesian expects w of a real floating (or integer) dtype, got w of dtype ...
  """
  x = jnp.asarray(value)
  if jnp.issubdtype(x.dtype, jnp.inexact if complex_ok else jnp.floating):
    return x
  if jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.bool_):
    return x.astype(jnp.result_type(float))
  kinds = 'floating, complex' if complex_ok else 'real floating'
  raise TypeError(f'{owner} expects {name} of a {kinds} (or integer) dtype, got {name} of dtype '
                  f'{x.dtype}.')
