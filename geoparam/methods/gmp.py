"""GmP, geometric parameterization (paper 002 eq. 15): `kernel = scale * u(theta)`, `bias = scale * lam`.

Stored: `theta (fan_in - 1, F)`, `lam (F,)`, `scale (F,)`, and at fan-in 1 a
fixed `sign (F,)` (the direction of one input is a sign: it gets no gradient and
only its sign is used, so weight decay cannot flip it). A layer with
`use_bias=False` gets no `lam`: a bias-free layer (a conv before a BatchNorm)
stays bias-free, so nothing (Adam's update of a ~0 gradient, weight decay) can
grow a bias that `bake` could not put back. `u(theta)` is the unit
vector of eq. (10), evaluated in float32 at least (bf16 angles evaluated in bf16
give column norms ~1.6 at fan-in 4608).

With the model's activation after the layer, the unit computes
`act(scale * (u^T x + lam))`: the paper's `scale * relu(u^T x + lam)` for relu
and `scale > 0`, and for any activation an exact reparameterization of
`(kernel, bias)`. The paper-form layers (`geoparam.GmPDense`) put the scale
outside the activation with `unit`.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from geoparam import methods
    >>> gmp = methods.get('gmp')
    >>> params = gmp.convert(np.array([[3.0], [4.0]]), np.array([1.0]), np.float32, True)
    >>> {k: np.round(np.float64(v), 4).tolist() for k, v in params.items()}  # lam = b / |w|
    {'theta': [[0.9273]], 'lam': [0.2], 'scale': [5.0]}
    >>> [a.round(5).tolist() for a in gmp.bake(params, (2, 1))]
    [[[3.0], [4.0]], [1.0]]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax.nn import initializers as jinit
from flax.core import meta
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from geoparam import checks
from geoparam import hyperspherical
from geoparam import initializers
from geoparam.methods import base

__all__ = ['gmp', 'gmp_imn', 'switched', 'paper', 'INITIALIZATIONS', 'unit',
           'gmp_kernel', 'from_dense_traced', 'from_dense', 'to_dense', 'columns']

INITIALIZATIONS = ('paper', 'layer')
_ROLES = {'theta': 'direction', 'lam': 'bias', 'scale': 'scale', 'sign': 'fixed'}


def gmp_kernel(theta: jax.Array, sign: jax.Array | None = None) -> jax.Array:
  """Unit-norm kernel `(fan_in, features)` from angles `(fan_in - 1, features)`.

  The map runs in float32 at least; the result has that dtype, callers cast after.
  For fan-in 1 (`theta` of shape `(0, features)`) the column is `sign(sign)`.

    >>> import jax.numpy as jnp, geoparam
    >>> u = geoparam.gmp_kernel(jnp.zeros((2, 3), jnp.bfloat16))
    >>> u.shape, u.dtype
    ((3, 3), dtype('float32'))
  """
  theta = jnp.asarray(theta)
  if theta.ndim != 2:
    raise ValueError(f'theta must have shape (fan_in - 1, features), got {theta.shape}.')
  if jnp.issubdtype(theta.dtype, jnp.floating):
    theta = theta.astype(jnp.promote_types(theta.dtype, jnp.float32))
  # The single-neuron map over neurons, theta (n - 1, m) -> u (n, m): the batched form runs the
  # same custom-VJP code on all columns at once (tested equal to vmapping `to_cartesian`).
  u = hyperspherical.to_cartesian_batched(theta)
  if theta.shape[0] == 0:
    if sign is None:
      raise ValueError('a fan-in-1 GmP unit needs its fixed `sign` parameter.')
    u = u * jnp.sign(lax.stop_gradient(sign)).astype(u.dtype)[None, :]
  return u


def unit(params: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array | None, jax.Array]:
  """`(u (fan_in, F), lam (F,), scale (F,))` in float32 at least: the unit before its scale.

  `lam` is None for a bias-free layer (no `lam` stored).
  """
  u = gmp_kernel(params['theta'], params.get('sign'))
  lam = params['lam'].astype(u.dtype) if 'lam' in params else None
  return u, lam, params['scale'].astype(u.dtype)


def _apply(params, kernel_shape):
  u, lam, scale = unit(params)
  return (u * scale).reshape(kernel_shape), None if lam is None else scale * lam


def from_dense_traced(kernel: jax.Array, bias: jax.Array) -> dict[str, jax.Array]:
  """`theta`, `lam`, `scale` (+ `sign` at fan-in 1) with `scale * u = kernel`, `scale * lam = bias`.

  Traceable (no checks on values): `kernel (fan_in, F)` with nonzero columns,
  `bias (F,)`. `from_dense` is the checked version.
  """
  if kernel.shape[0] == 1:
    scale = jnp.abs(kernel[0])
    return {'theta': jnp.zeros((0, kernel.shape[1]), kernel.dtype), 'lam': bias / scale,
            'scale': scale, 'sign': jnp.sign(kernel[0])}
  theta, scale = jax.vmap(hyperspherical.from_cartesian, in_axes=1, out_axes=(1, 0))(kernel)
  return {'theta': theta, 'lam': bias / scale, 'scale': scale}


def columns(mask, limit=10) -> str:
  """Indices where `mask` holds, at most `limit` of them, as text."""
  bad = np.flatnonzero(mask).tolist()
  more = f' (and {len(bad) - limit} more)' if len(bad) > limit else ''
  return f'{bad[:limit]}{more}'


def from_dense(kernel, bias=None) -> dict[str, jax.Array]:
  """GmP variables of a plain `kernel (..., F)` and `bias (F,)` (None: zeros), checked.

  In the kernel's dtype (the default float dtype for integer kernels); every
  `scale` is > 0 and every entry finite in that dtype, or this raises ValueError
  naming the columns (zero, non-finite, tiny or huge columns; overflowing `lam`).
  """
  # a real float kernel: an integer one becomes the default float, so a float bias is not truncated
  kernel = checks.floating(kernel, 'kernel', 'from_dense')
  if kernel.ndim < 2:
    raise ValueError(f'kernel must have shape (..., fan_in-part, features), got {kernel.shape}.')
  if kernel.size == 0:
    raise ValueError(f'kernel of shape {kernel.shape} is empty: it needs at least one unit (last '
                     'axis) and a fan-in of at least 1 (the other axes) to have a GmP form.')
  features = kernel.shape[-1]
  w = kernel.reshape(-1, features)
  dtype = w.dtype
  finfo = jnp.finfo(dtype)
  norms = np.linalg.norm(np.asarray(w, np.float64), axis=0)
  if np.any(norms == 0) or not np.all(np.isfinite(norms)):
    raise ValueError(
        f'kernel columns {columns((norms == 0) | ~np.isfinite(norms))} are zero or not finite: '
        'a zero weight vector has no direction, so it has no GmP form.')
  tiny = norms < float(finfo.tiny)
  if np.any(tiny):
    raise ValueError(
        f'kernel columns {columns(tiny)} have norm |w| (e.g. {norms[tiny][0]:.3g}) below the '
        f'smallest normal {dtype} number (np.finfo({dtype}).tiny = {float(finfo.tiny):.4g}): '
        f'scale = |w| underflows in {dtype} (XLA flushes subnormals to 0) and lam = b / |w| is '
        'not finite. Rescale those units or convert in float64.')
  huge = norms > float(finfo.max)
  if np.any(huge):
    raise ValueError(
        f'kernel columns {columns(huge)} have norm |w| (e.g. {norms[huge][0]:.3g}) above the '
        f'largest {dtype} number ({float(finfo.max):.4g}): scale = |w| overflows in {dtype}.')
  with np.errstate(over='ignore', invalid='ignore'):  # an overflowing cast is reported below
    bias = jnp.zeros((features,), dtype) if bias is None else jnp.asarray(bias, dtype)
  if bias.shape != (features,):
    raise ValueError(f'bias must have shape ({features},), got {bias.shape}.')
  bias_np = np.asarray(bias)
  if not np.all(np.isfinite(bias_np)):
    raise ValueError(
        f'bias entries {columns(~np.isfinite(bias_np))} are not finite in {dtype} (inf or NaN, '
        f'or beyond np.finfo({dtype}).max = {float(finfo.max):.4g} once cast to it).')
  out = from_dense_traced(w, bias)
  # Checked in the returned dtype: what the GmP model will compute with.
  scale_np, lam_np = np.asarray(out['scale']), np.asarray(out['lam'])
  bad_scale = ~(np.isfinite(scale_np) & (scale_np > 0))
  if np.any(bad_scale):
    raise ValueError(
        f'kernel columns {columns(bad_scale)}: scale = |w| is {scale_np[bad_scale][:3].tolist()} '
        f'in {dtype}, not a finite number > 0 (|w| near np.finfo({dtype}).tiny = '
        f'{float(finfo.tiny):.4g} or max = {float(finfo.max):.4g}).')
  bad_lam = ~np.isfinite(lam_np)
  if np.any(bad_lam):
    raise ValueError(
        f'columns {columns(bad_lam)}: lam = b / |w| overflows {dtype} (b = '
        f'{[f"{x:.3g}" for x in bias_np[bad_lam][:3]]}, |w| = '
        f'{[f"{x:.3g}" for x in norms[bad_lam][:3]]}; '
        f'np.finfo({dtype}).max = {float(finfo.max):.4g}). Rescale those units or convert in '
        'float64.')
  return out


def to_dense(params: Mapping[str, Any], kernel_shape=None) -> tuple[jax.Array, jax.Array]:
  """`(scale * u(theta), scale * lam)` of one layer's GmP variables, checked (shapes, finiteness).

  `kernel_shape`: the returned kernel's shape (e.g. a conv kernel); default `(fan_in, F)`.
  """
  if not isinstance(params, Mapping):
    raise TypeError(
        f"params must be a dict of one GmP layer's entries (theta, lam, scale), got "
        f'{type(params).__name__}.')
  missing = {'theta', 'lam', 'scale'} - set(params)
  if missing:
    raise ValueError(f'params lack GmP entries {sorted(missing)}; got keys {sorted(params)}.')
  theta = jnp.asarray(params['theta'])
  if theta.ndim != 2:
    raise ValueError(f'theta must have shape (fan_in - 1, features), got {theta.shape}.')
  features = theta.shape[1]
  entries = {k: np.asarray(params[k]) for k in ('theta', 'lam', 'scale', 'sign')
             if params.get(k) is not None}
  for name, value in entries.items():
    if name != 'theta' and value.shape != (features,):
      raise ValueError(
          f'{name} must have shape ({features},) to match theta of shape {theta.shape} (one '
          f'entry per feature), got shape {value.shape}.')
    if not np.all(np.isfinite(value)):
      raise ValueError(
          f'{name} has entries that are not finite (units '
          f'{columns(~np.isfinite(value).reshape(-1, features).all(axis=0))}).')
  scale = jnp.asarray(params['scale'])
  kernel = scale * gmp_kernel(theta, params.get('sign'))
  bias = scale * jnp.asarray(params['lam'])
  if kernel_shape is not None:
    kernel_shape = tuple(kernel_shape)
    if int(np.prod(kernel_shape)) != kernel.size or kernel_shape[-1] != kernel.shape[-1]:
      raise ValueError(
          f'kernel_shape {kernel_shape} does not hold a ({kernel.shape[0]}, {kernel.shape[1]}) '
          'kernel.')
    kernel = kernel.reshape(kernel_shape)
  return kernel, bias


def _convert(kernel, bias, dtype, use_bias):
  # Converted in the params' dtype (float32 at least: the angles are stored so), so its checks
  # (tiny columns, overflow) are that dtype's; lam and scale are then stored in `dtype`.
  wide = jnp.promote_types(dtype, jnp.float32)
  out = from_dense(jnp.asarray(kernel, wide), jnp.asarray(bias, wide))
  out = {k: v if k == 'theta' else v.astype(dtype) for k, v in out.items()}
  kept = base.with_layer_bias({}, out['lam'], dtype, use_bias, name='lam')
  return {k: v for k, v in out.items() if k != 'lam' or kept}


def _bake(params, kernel_shape):
  params = {k: meta.unbox(v) for k, v in params.items()}
  biased = 'lam' in params
  if not biased:
    params['lam'] = jnp.zeros_like(jnp.asarray(params['scale']))
  kernel, bias = to_dense(params, kernel_shape)
  return np.asarray(kernel, np.float64), np.asarray(bias, np.float64) if biased else None


def _from_kernel(kernel, bias, use_bias):
  out = from_dense_traced(kernel.reshape(-1, kernel.shape[-1]), bias)
  return {k: v for k, v in out.items() if k != 'lam' or use_bias}


def gmp(initialization: str = 'paper', theta_init=None, lam_init=None,
        scale_init=None) -> base.Method:
  """GmP as a `Method`.

  Args:
    initialization: `'paper'` (sphere-uniform `u`, `lam = 0`, `scale = 1`) or
      `'layer'` (the layer's own `kernel_init`/`bias_init` draw, converted exactly).
    theta_init, lam_init, scale_init: override the paper's initializers.
  """
  checks.one_of('initialization', initialization, INITIALIZATIONS)
  if initialization == 'layer' and any(i is not None for i in (theta_init, lam_init, scale_init)):
    raise ValueError("initialization='layer' takes the layer's own kernel_init/bias_init; "
                     'do not also pass theta_init, lam_init or scale_init.')

  def params(kernel_shape, layer, new_key):
    n, features = base.fan_in(kernel_shape), kernel_shape[-1]
    shapes = {'theta': (n - 1, features), 'lam': (features,), 'scale': (features,)}
    if not layer.use_bias:
      del shapes['lam']
    if n == 1:
      shapes['sign'] = (features,)
    if initialization == 'paper':
      inits = {'theta': theta_init or initializers.sphere_uniform(),
               'lam': lam_init or jinit.zeros,
               'scale': scale_init or jinit.ones, 'sign': initializers.rademacher()}
    else:

      def draw(dtype):  # the layer's own kernel_init/bias_init draw, all variables from it
        k_key, b_key = jax.random.split(new_key())  # the same key on every call
        bias_init = layer.bias_init if layer.use_bias else jinit.zeros
        return _from_kernel(meta.unbox(layer.kernel_init(k_key, kernel_shape, dtype)),
                            meta.unbox(bias_init(b_key, (features,), dtype)), True)

      inits = {name: (lambda name: lambda _, shape, dtype=jnp.float32: draw(dtype)[name])(name)
               for name in shapes}
    return {name: base.Param(shape, inits[name], jnp.float32 if name == 'theta' else None,
                             fixed=name == 'sign', role=_ROLES[name])
            for name, shape in shapes.items()}

  return base.Method('gmp', params, _apply, _convert, _bake, gain='scale',
                     from_kernel=_from_kernel, own_init=initialization == 'paper')


def gmp_imn(momentum: float = 0.99, axis_name: str | None = None, initialization: str = 'paper',
            theta_init=None, lam_init=None, scale_init=None) -> base.Method:
  """GmP with input mean normalization: `with_imn(gmp(...), momentum, axis_name)`."""
  method = gmp(initialization, theta_init, lam_init, scale_init)
  return base.with_imn(method, momentum, axis_name)._replace(name='gmp_imn')


def _unit_apply(params, kernel_shape):
  """The paper form's `(kernel, bias)`: `(u, lam)`; the scale multiplies after the activation."""
  u, lam, _ = unit(params)
  return u.reshape(kernel_shape), lam


def switched(input_mean_norm: bool = False, momentum: float = 0.99, axis_name: str | None = None,
             initialization: str = 'paper', theta_init=None, lam_init=None,
             scale_init=None) -> base.Method:
  """`gmp`, or `gmp_imn` where `input_mean_norm`: the method of the named GmP wrappers
  (`geoparam.GmP`, `geoparam.nnx.GmP`), whose options are its arguments. `momentum` is
  checked with IMN or without (set without IMN it would be ignored).

    >>> switched().name, switched(True, 0.9).imn.momentum
    ('gmp', 0.9)
    >>> switched('yes')
    Traceback (most recent call last):
    TypeError: input_mean_norm must be True or False, got 'yes'.
  """
  checks.flag('input_mean_norm', input_mean_norm)
  checks.momentum(momentum)
  if input_mean_norm:
    return gmp_imn(momentum, axis_name, initialization, theta_init, lam_init, scale_init)
  return gmp(initialization, theta_init, lam_init, scale_init)


def paper(activation=jax.nn.relu, input_mean_norm: bool = False, momentum: float = 0.99,
          axis_name: str | None = None, theta_init=initializers.sphere_uniform(),
          lam_init=jinit.zeros, scale_init=None, glorot_scale: bool = False) -> base.Method:
  """GmP in the paper's form, `scale * act(u(theta)^T x + lam)` (paper 002 eq. 15): the method of
  the paper-form layers (`geoparam.GmPDense`, `geoparam.nnx.GmPLinear`, ...), whose GmP fields
  are its arguments.

  The layer runs with `(u, lam)`; the record's `after` applies `activation` (None: linear),
  then the scale. `scale_init` None: ones, or with `glorot_scale` the norm of a Glorot-uniform
  draw of the layer's `(fan_in, features)` kernel, as the paper's reference code starts.

    >>> import jax.numpy as jnp
    >>> m = paper(activation=None)
    >>> params = {'theta': jnp.zeros((1, 2)), 'lam': jnp.ones(2), 'scale': jnp.array([2., 3.])}
    >>> m.apply(params, (2, 2))[1].tolist(), m.after(jnp.ones((1, 2)), params).tolist()
    ([1.0, 1.0], [[2.0, 3.0]])
  """
  checks.flag('glorot_scale', glorot_scale)
  checks.function('activation', activation, 'a function (e.g. jax.nn.relu) or None for linear',
                  optional=True)
  method = switched(input_mean_norm, momentum, axis_name, theta_init=theta_init,
                    lam_init=lam_init, scale_init=scale_init or jinit.ones)
  if glorot_scale and scale_init is None:
    specs_of = method.params

    def glorot_params(kernel_shape, layer, new_key):
      specs = specs_of(kernel_shape, layer, new_key)
      glorot = initializers.glorot_norm(base.fan_in(kernel_shape), kernel_shape[-1])
      return {**specs, 'scale': specs['scale']._replace(init=glorot)}

    method = method._replace(params=glorot_params)

  def after(y, params):  # `scale * act(y)`, in y's dtype (the layer's computation's)
    y = y if activation is None else activation(y)
    return params['scale'].astype(y.dtype) * y

  return method._replace(apply=_unit_apply, after=after)
