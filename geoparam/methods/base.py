"""The record every parameterization is: pure functions between stored variables and a layer's
`(kernel, bias)`, in optax's style (a `GradientTransformation` is a NamedTuple of pure functions).

A method sees a kernel with the output units on its last axis and the fan-in on
all others (`nn.Dense`'s `(fan_in, F)`, `nn.Conv`'s `(*window, in // groups, F)`,
`nn.DenseGeneral`'s `(*contracted, F)`; one with several output axes, e.g. an
attention projection's `(*contracted, heads, head_dim)`, is seen with them
flattened, `(*contracted, heads * head_dim)`: `geoparam.kinds.Layout`).
A method stores its own variables and stands for the kernel and bias they build;
the layer then runs unchanged (in its own layout).

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from geoparam import methods
    >>> wn = methods.get('wn')
    >>> params = methods.init(wn, jax.random.key(0), (3, 4))
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (4,), 'kernel': (3, 4), 'scale': (4,)}
    >>> kernel, bias = wn.apply(params, (3, 4))
    >>> np.linalg.norm(kernel, axis=0).round(4).tolist()
    [1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import math
from typing import Any, NamedTuple

from flax.core import meta
from jax.nn import initializers as jinit
import jax
import numpy as np

from geoparam import checks

__all__ = ['Method', 'Param', 'ROLES', 'Layer', 'IMN', 'with_imn', 'init', 'fan_in', 'check_fan_in',
           'stored_dtype', 'layer_dtype',
           'check_zero_sum', 'with_layer_bias', 'bias_names', 'dense_spec']

Shape = tuple[int, ...]
Initializer = Callable[..., jax.Array]
Params = Mapping[str, jax.Array]


class Param(NamedTuple):
  """One stored variable: its shape and its initializer `init(key, shape, dtype) -> array`.

  `min_dtype`: stored in at least this dtype whatever the layer's `param_dtype` (GmP's
  angles: the map's product of `fan_in` sines compounds their rounding, ~11% of the
  direction at fan-in 4608 in bf16, against ~0.2% for a bf16 kernel).
  `fixed`: gets no gradient (`apply` stops it: GmP's fan-in-1 `sign`), so not a
  trainable coordinate.
  `role`: what the variable is to an optimizer (`geoparam.param_groups`), one of `ROLES`:
  `'direction'` (GmP's angles, LCW's `v`, WN's and CWN's `kernel`), `'scale'` (a per-unit
  gain), `'bias'` (GmP's `lam`, a bias) or `'fixed'` (GmP's fan-in-1 `sign`).
  """
  shape: Shape
  init: Initializer
  min_dtype: Any = None
  fixed: bool = False
  role: str = 'direction'


#: The roles a method's variable may play (`Param.role`).
ROLES = ('direction', 'scale', 'bias', 'fixed')


def stored_dtype(param: Param, param_dtype) -> Any:
  """The dtype `param` is stored in when the layer's `param_dtype` is given.

    >>> import jax.numpy as jnp
    >>> theta = Param((3, 4), None, min_dtype=jnp.float32)
    >>> stored_dtype(theta, jnp.bfloat16), stored_dtype(Param((4,), None), jnp.bfloat16)
    (dtype('float32'), <class 'jax.numpy.bfloat16'>)
  """
  if param.min_dtype is None or not jax.numpy.issubdtype(param_dtype, jax.numpy.floating):
    return param_dtype
  return jax.numpy.promote_types(param_dtype, param.min_dtype)


def layer_dtype(params: Mapping[str, Any], specs: Mapping[str, Param]) -> Any:
  """The dtype the layer computes its kernel in: that of the variables stored in `param_dtype`
  (those without a `min_dtype`; all of them if every one has one)."""
  plain = [v for n, v in params.items() if specs[n].min_dtype is None] or list(params.values())
  return jax.numpy.result_type(*plain)


class Layer(NamedTuple):
  """What a method may read of the wrapped layer when it creates its variables.

  `kernel_init`, `bias_init`: the layer's own initializers (they may return
  `nn.Partitioned` boxes: methods unbox what they transform); `use_bias`: whether
  the layer has a bias.
  """
  kernel_init: Initializer = jinit.lecun_normal()
  bias_init: Initializer = jinit.zeros
  use_bias: bool = True


class IMN(NamedTuple):
  """Input mean normalization: the layer's input is centred, `layer(x - E[x])` (paper 002 eq. 16).

  `momentum`: running-mean decay; `axis_name`: a named axis to average the batch
  mean over (shard_map/pmap), as `nn.BatchNorm`.
  """
  momentum: float = 0.99
  axis_name: str | None = None


class Method(NamedTuple):
  """A parameterization of a layer's `(kernel, bias)`: pure functions, no state.

  Attributes:
    name: the registry's name (`'gmp'`, `'gmp_imn'`, `'lcw'`, ...).
    params: `params(kernel_shape, layer, new_key) -> {name: Param}`, the stored
      variables in creation order. `layer` is a `Layer`; `new_key()` gives the
      key of a joint draw for methods whose variables all come from one (the same
      key on every call; call it only inside the initializers).
    apply: `apply(params, kernel_shape) -> (kernel, bias)`: the kernel (in
      `kernel_shape`) and bias `(F,)` (or None) the layer computes with; float32
      at least where the map needs it (callers cast to the params' dtype).
    convert: `convert(kernel, bias, dtype, use_bias) -> params`: the stored
      variables standing exactly for a plain `kernel` (float64 numpy, kernel
      shape) and `bias` `(F,)` (float64, zeros when the layer has none), in
      `dtype`; raises ValueError where no exact form exists.
    bake: `bake(params, kernel_shape) -> (kernel, bias)`, float64 numpy, the
      inverse of `convert` (bias None when the method stores none).
    min_fan_in: the smallest fan-in the method supports; `fan_in_reason` says why.
    imn: `IMN(...)` when the layer's input is mean-normalized (see `with_imn`).
    gain: the per-unit variable `(kernel, bias)` are both linear in and that is
      each unit's kernel norm (GmP's `scale`, the paper's radius `r`): `apply`
      with it at 1 gives unit-norm kernel columns and `bias / |kernel|`. None
      where no variable is (WN's `scale` leaves the bias alone).
    from_kernel: `from_kernel(kernel, bias, use_bias) -> params`, traceable (jax,
      no checks): the stored variables standing for `kernel` (kernel shape) and
      `bias (F,)`, in their dtype; `convert` is its checked float64 form. None
      where the method has none.
    linear_in: the variable the layer's output minus its bias is linear in (LCW's
      `v`, CWN's and WN's `scale`: scaling it by `c` scales that part by `c`), which
      `geoparam.linen.variance.data_dependent_init` rescales. None where none is (GmP's
      `scale` scales the bias term `lam` too).
    own_init: the variables are drawn by the method's own initializers, not from the
      layer's `kernel_init`/`bias_init` (GmP's paper initialization).
    after: `after(y, params) -> y`, what follows the layer's output `y` where the method is
      not the layer with other weights (the paper form's activation and scale,
      `geoparam.methods.gmp.paper`); None for every method that is.
  """
  name: str
  params: Callable[[Shape, Layer, Callable[[], jax.Array]], dict[str, Param]]
  apply: Callable[[Params, Shape], tuple[jax.Array, jax.Array | None]]
  convert: Callable[[np.ndarray, np.ndarray, Any, bool], dict[str, jax.Array]]
  bake: Callable[[Params, Shape], tuple[np.ndarray, np.ndarray | None]]
  min_fan_in: int = 1
  fan_in_reason: str = ''
  imn: IMN | None = None
  gain: str | None = None
  from_kernel: Callable[[jax.Array, jax.Array, bool], dict[str, jax.Array]] | None = None
  linear_in: str | None = None
  own_init: bool = False
  after: Callable[[jax.Array, Params], jax.Array] | None = None


def with_imn(method: Method | str, momentum: float | None = None,
             axis_name: str | None = None) -> Method:
  """`method` with input mean normalization: GmP+IMN is `with_imn(gmp())`.

    >>> from geoparam import methods
    >>> methods.with_imn(methods.get('gmp')).imn
    IMN(momentum=0.99, axis_name=None)
    >>> methods.with_imn(methods.get('gmp_imn', momentum=0.5)).imn.momentum  # kept
    0.5

  `method`: a `Method`, or a registry name, built by `geoparam.methods.get` with its default
  options (`with_imn('wn')` is `with_imn(get('wn'))`; build it with `get` to pass options).
  `momentum`, `axis_name`: None keeps those of a method that has IMN already, else
  `IMN`'s defaults (0.99, no named axis).
  """
  if isinstance(method, str):
    from geoparam import methods  # pylint: disable=g-import-not-at-top (the registry imports us)
    method = methods.get(method)
  if not isinstance(method, Method):
    raise TypeError(f'with_imn: method must be a registry name or a geoparam.methods.Method, got '
                    f'{method!r:.80} of type {type(method).__name__}.')
  imn = method.imn or IMN()
  momentum = imn.momentum if momentum is None else checks.momentum(momentum)
  if axis_name is not None and not isinstance(axis_name, str):
    raise TypeError(f'axis_name must be None or the name (str) of a mapped axis, got '
                    f'{axis_name!r}.')
  return method._replace(imn=IMN(momentum, axis_name or imn.axis_name))


def fan_in(kernel_shape: Shape) -> int:
  """Every axis but the last: `prod(kernel_shape[:-1])`."""
  return math.prod(kernel_shape[:-1])


def check_fan_in(method: Method, kernel_shape: Shape, where: str) -> None:
  """Raises a ValueError naming `where` when the kernel's fan-in is below the method's minimum."""
  n = fan_in(kernel_shape)
  if n < method.min_fan_in:
    why = f': {method.fan_in_reason}' if method.fan_in_reason else ''
    raise ValueError(f'{where}: needs a fan-in of at least {method.min_fan_in}, got {n} '
                     f'(kernel {tuple(kernel_shape)}){why}.')


def init(method: Method, key: jax.Array, kernel_shape: Shape, layer: Layer = Layer(),
         dtype=np.float32) -> dict[str, jax.Array]:
  """The method's stored variables for a kernel of `kernel_shape`, from one key (unboxed).

  Each variable gets its own key (`fold_in` of its position), a joint draw one more.
  `kernel_shape` has the fan-in axes then the units, each >= 1 (else ValueError).
  """
  kernel_shape = tuple(kernel_shape)
  if len(kernel_shape) < 2 or not all(isinstance(d, (int, np.integer)) and d >= 1
                                      for d in kernel_shape):
    raise ValueError(f'kernel_shape must be at least 2 ints >= 1, the fan-in axes then the units '
                     f'(e.g. (fan_in, features)), got {kernel_shape}: a kernel with no units or '
                     'no fan-in has no parameters to make.')
  specs = method.params(kernel_shape, layer, lambda: jax.random.fold_in(key, 1 << 20))
  return {name: meta.unbox(p.init(jax.random.fold_in(key, i), p.shape, stored_dtype(p, dtype)))
          for i, (name, p) in enumerate(specs.items())}


def check_zero_sum(name: str, w: np.ndarray) -> None:
  """LCW and CWN: raises unless every unit (column of `w (fan_in, F)`) sums to zero."""
  sums = np.abs(w.sum(0))
  bad = sums > 1e-6 * np.linalg.norm(w, axis=0) * math.sqrt(w.shape[0]) + 1e-30
  if np.any(bad):
    raise ValueError(
        f'{name} constrains every unit\'s weights to sum to zero, but units '
        f'{np.flatnonzero(bad).tolist()[:10]} do not '
        f'(max |sum| {sums.max():.3g}): no {name} weights give the same function. '
        'Convert a model trained with zero-sum kernels, or train the reparameterized model.')


def with_layer_bias(params: dict, bias, dtype, use_bias: bool, name: str = 'bias') -> dict:
  """`params` plus the bias term `name` (`bias` in `dtype`), for `convert`; a layer without
  one (`use_bias=False`) raises unless `bias` is zero."""
  if use_bias:
    return {**params, name: jax.numpy.asarray(bias, dtype)}
  if np.any(np.asarray(bias) != 0):
    raise ValueError('has use_bias=False but a nonzero bias: a bias-free layer gets no bias '
                     'term (the transforms give one to a layer whose BatchNorm they drop).')
  return params


def bias_names(method: Method, kernel_shape: Shape) -> tuple[str, ...]:
  """The variables `method` stores only for a layer with a bias (GmP's `lam`, LCW's `bias`).

    >>> from geoparam import methods
    >>> bias_names(methods.get('gmp'), (3, 4)), bias_names(methods.get('wn'), (3, 4))
    (('lam',), ('bias',))
  """
  key = lambda: jax.random.key(0)
  with_bias = method.params(tuple(kernel_shape), Layer(use_bias=True), key)
  without = method.params(tuple(kernel_shape), Layer(use_bias=False), key)
  return tuple(n for n in with_bias if n not in without)


def dense_spec(method: Method, stored: Mapping[str, Any], where: str = 'dense_spec'
               ) -> tuple[tuple[int, int], dict[str, Param]]:
  """`((fan_in, F), {name: Param})`: the dense kernel a layer's `stored` variables stand for
  under `method`, read off the record's first variable, and the record's variables for it.

  Each stored variable's shape is checked (the `gain` may be absent); a ValueError names
  `where` and the first mismatch, missing or extra variable.

    >>> import numpy as np
    >>> from geoparam import methods
    >>> dense_spec(methods.get('gmp'), {'theta': np.zeros((2, 4)), 'lam': np.zeros(4)})[0]
    (3, 4)
  """
  first = next(iter(method.params((2, 1), Layer(), lambda: None)))
  shape = tuple(np.shape(stored[first])) if first in stored else ()
  for n in range(max(shape[0], 1), shape[0] + 2) if len(shape) == 2 else ():  # fan-in >= 1
    specs = [method.params((n, shape[1]), Layer(use_bias=b), lambda: None) for b in (True, False)]
    if first not in specs[0] or specs[0][first].shape != shape:
      continue
    spec = specs[0] if (set(specs[0]) - set(specs[1])) & set(stored) else specs[1]
    missing = [k for k in spec if k not in stored and k != method.gain]
    if set(stored) - set(spec):
      break
    if missing:
      raise ValueError(f'{where} needs entries {list(spec)}; missing {missing}, got keys '
                       f'{sorted(stored)}.')
    for name in stored:
      if tuple(np.shape(stored[name])) != spec[name].shape:
        raise ValueError(f'{where}: {name} must have shape {spec[name].shape} to match '
                         f'{first} of shape {shape}.')
    return (n, shape[1]), spec
  raise ValueError(f'{where}: the variables {({k: np.shape(v) for k, v in stored.items()})} are '
                   'not those the method stores for any dense kernel (fan_in, features).')
