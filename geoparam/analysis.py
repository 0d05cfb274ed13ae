"""Characteristic activation analysis (paper 002, Sec. 3): boundaries of ReLU units.

A ReLU unit `relu(w^T x + b)` is active on one side of the hyperplane
`B = {x : w^T x + b = 0}` (eq. 7). Its characteristic vector (spatial
location, eq. 8-9) is the point of `B` closest to the origin::

  phi = -b w / |w|^2 = -lam u,   u = w / |w| (unit normal),   lam = b / |w|

so `u` is the boundary direction and `lam` its signed distance from the
origin (`|phi| = |lam|`). Under GmP `u = u(theta)` and `lam` are parameters.

Every function takes ONE layer's variables as a plain dict, in the canonical
form of its parameterization `kind` (shapes: `n` = fan-in, `m` = features):

  'sp'      {'kernel': (n, m), 'bias': (m,) optional}
  'wn'      {'kernel': v (n, m), 'scale': g (m,), 'bias': (m,) optional}; w = g v / |v|
  'wn_mbn'  WN without bias plus mean-only batch norm on the pre-activations:
            {'kernel', 'scale', 'mbn': {'bias': (m,)}, 'batch_stats': {'mean': (m,)}}
  'bn'      Dense then BatchNorm on the pre-activations:
            {'dense': {'kernel': (n, m), 'bias': (m,) optional},
             'bn': {'scale': (m,) optional, 'bias': (m,) optional},
             'batch_stats': {'mean': (m,), 'var': (m,)}, 'epsilon': float optional (1e-5)}
  'gmp'     {'theta': (n - 1, m), 'lam': (m,), 'scale': (m,) optional, 'sign': (m,) at n = 1}
  'gmp_imn' GmP with input mean normalization: the 'gmp' dict plus
            {'batch_stats': {'mean': (n,)}} (the running input mean)

'wn', 'gmp' and 'gmp_imn', like any other method of `geoparam.methods.REGISTRY`
(`'lcw'`, `'cwn'`, a registered one) or a `geoparam.methods.Method`, are read
through the method's record: the dict holds the variables it stores for a dense
layer (plus `batch_stats/mean` when it has IMN), its `apply` gives the effective
`(w, b)`, and a method with a `gain` (GmP's `scale`) is seen at gain 1.

Shapes are checked (statically, so under `jit` too): a per-unit entry (bias,
gain, `lam`, `sign`, BN/MBN statistics) whose shape is not `(m,)`, or an IMN
mean not of shape `(n,)`, raises `ValueError` naming both shapes; nothing is
broadcast.

BN and MBN are folded into an effective affine map with the statistics in
`batch_stats` (running statistics: the evaluation-mode function). To analyse
the training-mode function, pass the batch's statistics instead (see
`batch_statistics`). Where a model keeps a layer's variables is the model's
business: `experiments.lib.models.layer_variables` assembles these dicts from the
studies' models.

Conventions:

- **Inputs in R^1** (n = 1): the boundary is the point `phi = -b / w`; the
  direction is `sign(w)` in {-1, +1} (the paper's angle 0 or pi), `lam = b / |w|`
  and `phi = -lam sign(w)`. A GmP unit with fan-in 1 takes its sign from the
  fixed `sign` parameter. Angle changes in R^1 are 0 or pi.
- **Zero weight vectors** (`w = 0`, e.g. `g = 0` under WN or `gamma = 0` under
  BN): the unit's pre-activation is the constant `b`, so it has no boundary, no
  direction and no location `phi`. One convention for `boundary_distance`,
  `boundary_direction`, `boundary_location`, `snapshot` and `angle_change` (a zero
  direction makes no angle): called on concrete arrays they raise ValueError naming
  the argument and the units (kernel columns); traced (under `jit`, `vmap`,
  `scan_tracked`, where values are not known) those units' entries are NaN, and
  `location_change` of a NaN location is NaN. As `hyperspherical.from_cartesian`
  and `hyperspherical.angle_between` do for a zero vector.
- **Scale**: the boundary does not depend on a unit's output scale (GmP `r`),
  so `scale` is ignored.

All functions are pure and jit/vmap friendly; inside `lax.scan` use
`scan_tracked` to record a layer's boundaries during training.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from geoparam import checks
from geoparam import methods

__all__ = [
  'KINDS',
  'BoundarySnapshot',
  'affine',
  'angle_change',
  'batch_statistics',
  'boundary_direction',
  'boundary_distance',
  'boundary_location',
  'location_change',
  'max_angle_change',
  'max_location_change',
  'perturb',
  'scan_tracked',
  'snapshot',
]

KINDS = ('sp', 'wn', 'wn_mbn', 'bn', 'gmp', 'gmp_imn')
BN_EPSILON = 1e-5  # nn.BatchNorm's default


def _method_of(kind) -> methods.Method | None:
  """The method record of a kind: a name of `geoparam.methods.REGISTRY` or a
  `geoparam.methods.Method`; None for the kinds that are no method ('sp', 'bn', 'wn_mbn').
  Raises for an unknown kind."""
  if isinstance(kind, methods.Method):
    return kind
  if isinstance(kind, str) and kind in methods.REGISTRY:
    return methods.get(kind)
  if kind not in KINDS:
    raise ValueError(f'unknown parameterization kind={kind!r}; valid kinds: {", ".join(KINDS)}, '
                     f'or a method of geoparam.methods.REGISTRY ({", ".join(methods.REGISTRY)}) '
                     'or a geoparam.methods.Method.')
  return None


def _name(kind) -> str:
  return getattr(kind, 'name', kind)


def _stored(params, kind) -> dict[str, jax.Array]:
  """A layer's stored variables: `params` without `batch_stats` and None entries."""
  _need(params, (), kind)
  return {k: jnp.asarray(v) for k, v in params.items() if k != 'batch_stats' and v is not None}


def _method_affine(params, method: methods.Method, kind):
  """`(w, b)` of a dense layer under any method: its `apply` (at gain 1 where it has a gain),
  then IMN's running mean folded."""
  stored = _stored(params, kind)
  shape, _ = methods.base.dense_spec(method, stored, f'kind={_name(kind)!r}')
  if method.gain is not None:  # drop the positive output scale: w = u, b = lam
    stored[method.gain] = jnp.ones(shape[1:])
  w, b = method.apply(stored, shape)
  w = _kernel(w)
  b = jnp.zeros(shape[1:], w.dtype) if b is None else _per_feature(b, 'bias', w, kind)
  if method.imn is not None:
    _need(params, ('batch_stats',), kind)
    _need(params['batch_stats'], ('mean',), kind)
    mean = _per_feature(params['batch_stats']['mean'], 'batch_stats/mean (the running input mean)',
                        w, kind, axis=0)
    b = b - mean @ w
  return w, b


def _need(params: Mapping[str, Any], keys, kind: str):
  if not isinstance(params, Mapping):
    raise ValueError(f'kind={kind!r} expects a dict of layer variables, got {type(params).__name__}.')
  missing = [k for k in keys if k not in params]
  if missing:
    raise ValueError(
        f'kind={kind!r} needs entries {list(keys)}; missing {missing}, got keys {sorted(params)}. '
        'See geoparam.analysis for the canonical layer dicts.')


def _kernel(kernel) -> jax.Array:
  kernel = jnp.asarray(kernel)
  if kernel.ndim != 2:
    raise ValueError(f'kernel must have shape (fan_in, features), got {kernel.shape}.')
  if not jnp.issubdtype(kernel.dtype, jnp.floating):
    kernel = kernel.astype(jnp.result_type(float))
  return kernel


def _per_feature(value, name, kernel, kind, axis: int = 1) -> jax.Array:
  """A vector checked against the kernel `(fan_in, features)`, in its dtype: per unit
  `(features,)`, or per input `(fan_in,)` with `axis=0` (IMN's running mean)."""
  value, size = jnp.asarray(value, kernel.dtype), kernel.shape[axis]
  if value.shape != (size,):
    against = (f'the kernel of shape {kernel.shape} (one entry per feature)' if axis else
               f'fan_in = {size}')
    raise ValueError(f'kind={kind!r}: {name} must have shape ({size},) to match {against}, got '
                     f'shape {value.shape}.')
  return value


def _bias(params, key, kernel, kind, name=None, default=0.0) -> jax.Array:
  """The per-unit entry `params[key]` (`name` in messages), `default` where it is absent."""
  _need(params, (), kind)
  if params.get(key) is None:
    return jnp.full(kernel.shape[1:], default, kernel.dtype)
  return _per_feature(params[key], name or key, kernel, kind)


def _sp_affine(params, kind, name: str = 'bias'):
  """'sp': the plain Dense's `(kernel, bias)` (`name`: the bias's, in messages)."""
  _need(params, ('kernel',), kind)
  w = _kernel(params['kernel'])
  return w, _bias(params, 'bias', w, kind, name)


def _wn_mbn_affine(params, kind):
  """'wn_mbn': WN's `(w, 0)` then the mean-only BN: `b = mbn/bias - mean`."""
  _need(params, ('kernel', 'scale', 'batch_stats'), kind)
  _need(params['batch_stats'], ('mean',), kind)
  w, _ = _method_affine({k: params[k] for k in ('kernel', 'scale')}, methods.get('wn'), kind)
  shift = _bias(params.get('mbn', {}), 'bias', w, kind, 'mbn/bias')
  return w, shift - _per_feature(params['batch_stats']['mean'], 'batch_stats/mean', w, kind)


def _bn_affine(params, kind):
  """'bn': the Dense, then BatchNorm folded with `batch_stats`:
  `gamma (w^T x + b - mean) / sqrt(var + eps) + beta`."""
  _need(params, ('dense', 'batch_stats'), kind)
  bn, stats = params.get('bn', {}), params['batch_stats']
  _need(stats, ('mean', 'var'), kind)
  w, b = _sp_affine(params['dense'], kind, 'dense/bias')
  eps = jnp.asarray(params.get('epsilon', BN_EPSILON), w.dtype)
  if eps.ndim != 0:
    raise ValueError(f"kind='bn': epsilon must be a scalar, got shape {eps.shape}.")
  gamma = _bias(bn, 'scale', w, kind, 'bn/scale', default=1.0)
  beta = _bias(bn, 'bias', w, kind, 'bn/bias')
  mean = _per_feature(stats['mean'], 'batch_stats/mean', w, kind)
  var = _per_feature(stats['var'], 'batch_stats/var', w, kind)
  factor = gamma / jnp.sqrt(var + eps)
  return w * factor[None, :], factor * (b - mean) + beta


# The kinds that are no method (module docstring), each with its `(w, b)`.
_NOT_METHODS = {'sp': _sp_affine, 'wn_mbn': _wn_mbn_affine, 'bn': _bn_affine}


def affine(params: Mapping[str, Any], kind: str) -> tuple[jax.Array, jax.Array]:
  """Effective affine map `(w, b)` of a layer: unit i is `relu(w[:, i]^T x + b[i])` up to a factor.

  Args:
    params: one layer's variables in the canonical form of `kind` (module docstring).
    kind: one of `KINDS`.

  Returns:
    `(w, b)`: `w` of shape `(fan_in, features)`, `b` of shape `(features,)`.
    For a method with a gain (GmP) `w = u(theta)` (unit columns) and `b = lam`
    (the positive output scale is dropped); BN and MBN are folded with `batch_stats`.
  """
  method = _method_of(kind)
  if method is not None:
    return _method_affine(params, method, kind)
  return _NOT_METHODS[kind](params, kind)


def _refuse_zero(norm, where: str, arg: str, what: str) -> None:
  """Raises a ValueError naming `arg` and the units (last axis) whose `what` has a zero `norm`
  `(..., units)`; a traced `norm` is not checked (those units come out NaN)."""
  if isinstance(norm, jax.core.Tracer):
    return
  zero = np.any(np.asarray(norm == 0).reshape(-1, norm.shape[-1]), axis=0)
  if np.any(zero):
    raise ValueError(
        f'{where}: units {methods.gmp.columns(zero)} have a zero {what} in {arg}: a unit '
        'with no direction has no activation boundary, no location phi and makes no angle. '
        'Leave those units out; traced (under jit, vmap, scan_tracked) their entries are NaN.')


def _direction_distance(params, kind, fn: str):
  """`(u (features, fan_in), lam (features,))`; zero weight vectors raise (concrete) or give NaN
  (traced), see the module docstring. `fn`: the caller's name, for the error."""
  w, b = affine(params, kind)
  if getattr(_method_of(kind), 'gain', None) is not None:  # w is u, a unit vector: no division
    return w.T, b
  norm = jnp.sqrt(jnp.sum(w * w, axis=0))
  _refuse_zero(norm, f'{fn}(kind={_name(kind)!r})', 'params', 'weight vector (w = 0)')
  ok = norm > 0
  safe = jnp.where(ok, norm, 1.0)
  u = jnp.where(ok[None, :], w / safe, jnp.nan)
  lam = jnp.where(ok, b / safe, jnp.nan)
  return u.T, lam


def _locations(params, kind, fn: str):
  """`(phi, u)`, each `(features, fan_in)`; a `lam` that overflows gives a row of `+inf`."""
  u, lam = _direction_distance(params, kind, fn)
  return jnp.where(jnp.isinf(lam)[:, None], jnp.inf, -lam[:, None] * u), u


def boundary_direction(params: Mapping[str, Any], kind: str) -> jax.Array:
  """Unit normal `u = w / |w|` of each unit's boundary, shape `(features, fan_in)`.

  In R^1 this is `sign(w)`. A zero weight vector raises ValueError (concrete params) or
  gives a row of NaN (traced): see the module docstring.
  """
  return _direction_distance(params, kind, 'boundary_direction')[0]


def boundary_distance(params: Mapping[str, Any], kind: str) -> jax.Array:
  """Signed distance `lam = b / |w|` of each boundary from the origin, shape `(features,)`.

  `phi = -lam u`, so `|phi| = |lam|`. A zero weight vector raises ValueError (concrete
  params) or gives NaN (traced): see the module docstring.
  """
  return _direction_distance(params, kind, 'boundary_distance')[1]


def boundary_location(params: Mapping[str, Any], kind: str) -> jax.Array:
  """Characteristic vector `phi = -b w / |w|^2 = -lam u` of each unit (eq. 8-9).

  Args:
    params: one layer's variables in the canonical form of `kind` (module docstring).
    kind: one of `KINDS` ('sp', 'wn', 'wn_mbn', 'bn', 'gmp', 'gmp_imn'), or any method of
      `geoparam.methods.REGISTRY` (a name or a `Method`) for a dense layer's variables.

  Returns:
    `phi`, shape `(features, fan_in)`: the point of unit i's boundary nearest to
    the origin; `u[i]^T phi[i] + lam[i] = 0`. In R^1 (`fan_in = 1`) it is the
    characteristic point `-b / w`.

  Raises:
    ValueError: for concrete params where a unit has a zero weight vector (`w = 0`: no
      boundary, no location), naming the units. Traced (under `jit`, `vmap`, `grad`, where
      values are not known) such a unit gives a row of NaN instead.

  Example usage::

    >>> import jax.numpy as jnp
    >>> from geoparam import analysis
    >>> layer = {'kernel': jnp.array([[2.0, -4.0]]), 'bias': jnp.array([1.0, 1.0])}
    >>> analysis.boundary_location(layer, 'sp').tolist()
    [[-0.5], [0.25]]
    >>> analysis.boundary_location(dict(layer, bias=jnp.ones(3)), 'sp')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
      ...
    ValueError: kind='sp': bias must have shape (2,) to match the kernel of shape (1, 2) ...
    >>> analysis.boundary_location(dict(layer, kernel=jnp.array([[2.0, 0.0]])), 'sp')
    Traceback (most recent call last):
      ...
    ValueError: boundary_location(kind='sp'): units [1] have a zero weight vector (w = 0) in ...
  """
  return _locations(params, kind, 'boundary_location')[0]


def _pair(before, after, fn: str) -> tuple[jax.Array, jax.Array]:
  """`before`, `after` as arrays of one shape `(features, n)`; else a ValueError naming `fn`."""
  before, after = jnp.asarray(before), jnp.asarray(after)
  if before.shape != after.shape or before.ndim != 2:
    raise ValueError(f'{fn} expects two arrays of the same shape (features, n), got '
                     f'{before.shape} and {after.shape}.')
  return before, after


def angle_change(before: jax.Array, after: jax.Array, degrees: bool = False) -> jax.Array:
  """Angle between each unit's direction before and after, eq. (12).

  Args:
    before, after: directions or weight vectors, shape `(features, n)` (the norm
      does not matter), e.g. `boundary_direction` of two parameter states.
    degrees: return degrees instead of radians.

  Returns:
    shape `(features,)`, in `[0, pi]` (or `[0, 180]`): `arccos(a^T b / (|a| |b|))`,
    computed in the form `2 atan2(| |b| a - |a| b |, | |b| a + |a| b |)`, which is
    accurate near 0 and pi. A zero vector (no direction) on either side raises
    ValueError naming `before` or `after` and the units (concrete arrays) or gives NaN
    (traced).
  """
  before, after = _pair(before, after, 'angle_change')
  na = jnp.linalg.norm(before, axis=1, keepdims=True)
  nb = jnp.linalg.norm(after, axis=1, keepdims=True)
  _refuse_zero(na[:, 0], 'angle_change', 'before', 'vector')
  _refuse_zero(nb[:, 0], 'angle_change', 'after', 'vector')
  x = before * nb
  y = after * na
  angle = 2 * jnp.arctan2(jnp.linalg.norm(x - y, axis=1), jnp.linalg.norm(x + y, axis=1))
  angle = jnp.where((na[:, 0] > 0) & (nb[:, 0] > 0), angle, jnp.nan)
  return jnp.degrees(angle) if degrees else angle


def location_change(before: jax.Array, after: jax.Array) -> jax.Array:
  """Euclidean distance `|phi_after - phi_before|` per unit, shape `(features,)`.

  Inputs of shape `(features, n)`. A unit whose location is infinite on one
  side only moved by `+inf`; one that stays at the same infinity moved by 0; one
  without a location (NaN: a zero weight vector, traced) gives NaN.
  """
  before, after = _pair(before, after, 'location_change')
  diff = jnp.where(after == before, 0.0, after - before)  # inf - inf where both equal -> 0
  return jnp.sqrt(jnp.sum(diff * diff, axis=1))


def max_location_change(locations: jax.Array) -> jax.Array:
  """`max_i |phi_{i,t+1} - phi_{i,t}|` per step: `(steps, features, n)` -> `(steps - 1,)`."""
  locations = jnp.asarray(locations)
  if locations.ndim != 3:
    raise ValueError(f'expected locations of shape (steps, features, n), got {locations.shape}.')
  return jnp.max(jax.vmap(location_change)(locations[:-1], locations[1:]), axis=1)


def max_angle_change(directions: jax.Array, degrees: bool = True) -> jax.Array:
  """`max_i angle(u_{i,t}, u_{i,t+1})` per step: `(steps, features, n)` -> `(steps - 1,)`.

  The angle of the weight direction for SP/WN/BN; under GmP the angle between
  `u(theta_t)` and `u(theta_{t+1})`, which equals `|theta_{t+1} - theta_t|` in
  R^2 while the step is below pi (Theorem 3 bounds it by the step's norm).
  A zero direction raises or gives NaN, as in `angle_change`.
  """
  directions = jnp.asarray(directions)
  if directions.ndim != 3:
    raise ValueError(f'expected directions of shape (steps, features, n), got {directions.shape}.')
  _refuse_zero(jnp.linalg.norm(directions, axis=2), 'max_angle_change', 'directions', 'vector')
  change = jax.vmap(lambda a, b: angle_change(a, b, degrees))(directions[:-1], directions[1:])
  return jnp.max(change, axis=1)


# The trainable entries of the kinds that are no method; a method's are its variables not `fixed`.
_TRAINABLE = {
    'sp': (('kernel',), ('bias',)),
    'wn_mbn': (('kernel',), ('scale',), ('mbn', 'bias')),
    'bn': (('dense', 'kernel'), ('dense', 'bias'), ('bn', 'scale'), ('bn', 'bias')),
}


def _check_eps(eps) -> None:
  """`perturb`'s size: real numbers; where concrete, finite."""
  if checks.real_dtype(eps) is None:
    raise TypeError(f'perturb: eps must be a real number or array (the perturbation size), got '
                    f'{eps!r:.60} of type {type(eps).__name__}.')
  if not isinstance(eps, jax.core.Tracer) and not np.all(np.isfinite(np.asarray(eps))):
    raise ValueError(f'perturb: eps must be finite (a perturbation size such as 1e-3; negative '
                     f'moves the other way), got eps = {eps!r:.60}: every parameter would become '
                     'inf or NaN.')


def perturb(params: Mapping[str, Any], eps, kind: str) -> dict[str, Any]:
  """Adds `eps` to every trainable parameter of a layer, in its own coordinates (Fig. 1b-e).

  SP: `w + eps, b + eps`; WN: `v + eps, g + eps, b + eps`; BN: the Dense
  kernel/bias and BN gamma/beta; GmP: `theta + eps, lam + eps, scale + eps`.
  Running statistics, `epsilon` and GmP's fixed fan-in-1 `sign` are left alone.
  `eps` is a scalar (the paper's `eps * 1`) or broadcasts against each parameter;
  a negative one moves the other way (the paper's sizes are positive). Returns a
  new dict of the same structure.

  Raises TypeError for an `eps` that is not a real number or array (str, None,
  bool, complex) and ValueError for a concrete one with an inf or NaN entry
  (which would make every parameter non-finite); a traced `eps` is not checked.
  """
  _check_eps(eps)
  method = _method_of(kind)
  _need(params, (), kind)
  out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in params.items()}
  touched = 0
  if method is not None:
    spec = methods.base.dense_spec(method, _stored(params, kind), f'kind={_name(kind)!r}')[1]
    trainable = tuple((k,) for k, p in spec.items() if not p.fixed)
  else:
    trainable = _TRAINABLE[kind]
  for *outer, key in trainable:  # a path of one or two keys
    node = out.get(outer[0]) if outer else out
    if isinstance(node, Mapping) and node.get(key) is not None:
      node[key] = jnp.asarray(node[key]) + eps
      touched += 1
  if not touched:
    raise ValueError(f'no trainable entries of kind={kind!r} found in keys {sorted(params)}.')
  return out


def batch_statistics(pre_activations: jax.Array) -> dict[str, jax.Array]:
  """Training-mode BN statistics `{'mean', 'var'}` (each `(features,)`) of `(batch, features)`.

  Pass them as `batch_stats` to analyse the function BN computes on this batch
  (for 'bn' the pre-activations are `x @ kernel + bias` of the Dense layer).
  """
  h = jnp.asarray(pre_activations)
  if h.ndim != 2:
    raise ValueError(f'expected pre-activations of shape (batch, features), got {h.shape}.')
  return {'mean': jnp.mean(h, axis=0), 'var': jnp.var(h, axis=0)}


class BoundarySnapshot(NamedTuple):
  """One layer's boundaries (`snapshot`); `scan_tracked` stacks them over steps.

  Attributes:
    location: `(features, fan_in)`, each unit's location `phi` (`boundary_location`);
      stacked: `(steps, features, fan_in)`.
    direction: `(features, fan_in)`, each unit's unit normal `u` (`boundary_direction`);
      stacked likewise.
  """
  location: jax.Array
  direction: jax.Array


def snapshot(params: Mapping[str, Any], kind: str) -> BoundarySnapshot:
  """Locations and directions of one layer's boundaries, as one pytree.

  A zero weight vector raises ValueError (concrete params) or gives NaN rows (traced, as
  inside `scan_tracked`): see the module docstring.
  """
  return BoundarySnapshot(*_locations(params, kind, 'snapshot'))


def scan_tracked(step: Callable, carry, xs=None, length: int | None = None, *,
                 layer: Callable[[Any], Mapping[str, Any]], kind: str, every: int = 1):
  """`jax.lax.scan(step, carry, xs, length)` that also records a layer's boundaries.

  Args:
    step: `(carry, x) -> (carry, y)`, one training step.
    carry, xs, length: as in `jax.lax.scan`.
    layer: `carry -> canonical layer dict` (e.g. `lambda c: c.params['hidden_0']`
      for a GmP layer), the layer to watch.
    kind: the layer's parameterization, one of `KINDS`.
    every: record after every `every` steps; `length` must be a multiple.

  Returns:
    `(carry, ys, track)`: `carry` and `ys` exactly as `lax.scan` returns them;
    `track` a `BoundarySnapshot` whose fields have shape
    `(length // every + 1, features, fan_in)`: index 0 is the state before the
    first step, index k the state after `k * every` steps. Feed
    `track.location` to `max_location_change` and `track.direction` to
    `max_angle_change`. Everything stays inside one traced scan (jit-able).
  """
  every = checks.count('every', every, 1)
  length = None if length is None else checks.count('length', length)
  if xs is not None:
    n = jax.tree.leaves(xs)[0].shape[0]
    if length is not None and length != n:
      raise ValueError(f'length={length} differs from the leading axis of xs ({n}).')
    length = n
  if length is None:
    raise ValueError('scan_tracked needs xs or length.')
  if length % every:
    raise ValueError(f'every={every} must divide length={length}.')
  chunks = length // every
  chunked_xs = None if xs is None else jax.tree.map(
      lambda a: a.reshape((chunks, every) + a.shape[1:]), xs)

  def chunk(c, x):
    c, y = jax.lax.scan(step, c, x, length=every)
    return c, (y, snapshot(layer(c), kind))

  first = snapshot(layer(carry), kind)
  carry, (ys, track) = jax.lax.scan(chunk, carry, chunked_xs, length=chunks)
  ys = jax.tree.map(lambda a: a.reshape((length,) + a.shape[2:]), ys)
  track = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, track)
  return carry, ys, track
