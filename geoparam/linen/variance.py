"""Minibatch-based initialization (paper 003 Sec. 4.3) and variance analysis (Sec. 4) in linen.

Both work on any Flax model by intercepting the `__call__` of its linear layers
(`nn.Intercept` via `nn.intercept_methods`), in execution order:

* `data_dependent_init` rescales each layer, first to last, so that its output
  (the pre-activation) has unit variance on one minibatch.
* `variance_analysis` records, per layer, mean and variance of the
  pre-activations (forward chain) and of the loss gradient with respect to
  them (backward chain), plus the activation-shift strength (003 Fig. 1).

"Variance of a layer" is pooled over every element of its output (batch,
spatial positions and units), like the per-layer boxplots of 003 Fig. 4.
The framework-neutral part (`activation_variance_factors`, `activation_shift`,
`LayerStats`) is `geoparam.variance`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import flax
from flax import traverse_util
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from geoparam import conv
from geoparam import kinds
from geoparam.linen import transform
from geoparam.selection import name as _name
from geoparam.variance import LayerStats
from geoparam.variance import activation_shift

__all__ = [
    'scaled_param',
    'data_dependent_init',
    'variance_analysis',
]


def scaled_param(module: nn.Module) -> str | None:
  """The parameter a linear layer's output minus its bias is linear in, which
  `data_dependent_init` rescales: a plain `nn.Dense`'s or `nn.Conv`'s `kernel`, a
  reparameterized layer's method's `linear_in` (LCW's `v`, CWN's and WN's `scale`); None for
  other layers. GmP has none: its pre-activation `u^T x + lam` has a unit direction and no free
  scale, so the init leaves GmP layers unchanged."""
  if getattr(module, 'reparameterized', False):
    get_method = getattr(module, 'get_method', None)
    return None if get_method is None else get_method().linear_in
  return 'kernel' if kinds.of(module) in (kinds.DENSE, kinds.CONV) else None


def _intercepting_apply(model, variables, inputs, counts, on_output, method, apply_kwargs):
  """Runs `model.apply`, passing each outermost call of a layer that `counts(module)` through
  `on_output`.

  `on_output(module, key, y) -> y'`, `key` the layer's path joined by '/' (its
  class name for a top-level layer), with '#k' appended for the k-th reuse of a
  shared layer.
  """
  depth = [0]
  seen: dict[str, int] = {}

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if (context.method_name != '__call__' or depth[0] > 0 or conv.bypassed()
        or not counts(module)):  # bypassed: a layer's own inner nn.Dense
      return next_fun(*args, **kwargs)
    depth[0] += 1  # layers built inside a layer (LCWConv's nn.Conv) are not separate layers
    try:
      y = next_fun(*args, **kwargs)
    finally:
      depth[0] -= 1
    key = '/'.join(module.path) or type(module).__name__
    count = seen.get(key, 0)
    seen[key] = count + 1
    if count:
      key = f'{key}#{count}'
    return on_output(module, key, y)

  with nn.intercept_methods(interceptor):
    out = model.apply(variables, inputs, method=method, **apply_kwargs)
  return out[0] if apply_kwargs.get('mutable') else out  # not the updated collections


def data_dependent_init(
    model: nn.Module,
    variables: Mapping[str, Any],
    inputs: Any,
    *,
    param_of: Callable[[nn.Module], str | None] = scaled_param,
    method: Callable[..., Any] | str | None = None,
    **apply_kwargs,
) -> dict[str, Any]:
  """Rescales every linear layer so its pre-activation has unit variance on `inputs`.

  One forward pass in execution order: each layer's output `z = h + b` (`b`
  its bias) is replaced on the fly by `c h + b` with `c = 1 / std(h)`, so later
  layers see the rescaled signal, and the layer's scaled parameter (see
  `scaled_param`) is multiplied by `c`. The variance is pooled over all
  elements of `h`; with zero biases (the usual init) `var(z) = 1` exactly.
  Deterministic. Layers of other types (GmP, normalization) are unchanged. A model
  of `geoparam.reparameterize` rescales its method's `linear_in` in the layers it
  reparameterized (none for GmP) and the kernels of those it keeps plain.
  Layers wrapped in `nn.SpectralNorm` / `nn.WeightNorm` are not supported
  (the wrapper renormalizes the kernel; paper 003 gives SN models Glorot init).

  Args:
    model: the Flax module.
    variables: its variables (`{'params': ..., ...}`).
    inputs: one minibatch, passed as `model.apply(variables, inputs, ...)`.
    param_of: `param_of(layer) -> name or None`, the parameter to scale (None: the layer is
      not rescaled); default `scaled_param`.
    method: forwarded to `model.apply`.
    **apply_kwargs: forwarded to `model.apply` (e.g. `train=True,
      mutable=['batch_stats']`; the updated collections are discarded).

  Returns:
    new variables with the rescaled parameters (other collections unchanged).
  """
  names: dict[tuple[str, ...], str] = {}  # static, filled while tracing

  def param(module):
    """`param_of(module)`; for a layer the whole-model transform reparameterizes (it holds the
    method's variables, not a kernel), the method's `linear_in`."""
    name, held = param_of(module), module.variables.get('params', {})
    if (name is not None and isinstance(model, transform.Reparameterized)
        and not getattr(module, 'reparameterized', False)
        and transform.selected(model, module, tuple(module.path))):
      name = model.get_method().linear_in
    if name == 'kernel' and set(held) - {'kernel', 'bias'}:  # e.g. a nested reparameterize
      raise ValueError(f'data_dependent_init: layer {_name(module.path)} holds '
                       f"{sorted(held)}, not a plain layer's kernel and bias: pass the model "
                       'that geoparam.reparameterize returned itself.')
    if name is not None and name not in held:
      raise ValueError(f'data_dependent_init: layer {_name(module.path)} holds no parameter '
                       f'{name!r} to rescale (it holds {sorted(held)}).')
    return name

  def factors_of(variables, inputs):
    factors: dict[tuple[str, ...], jax.Array] = {}

    def on_output(module, key, y):
      del key
      path = tuple(module.path)
      params = module.variables.get('params', {})
      bias = params.get('bias') if isinstance(params, Mapping) else None
      h = y if bias is None else y - bias
      if path not in factors:
        names[path] = param(module)
        factors[path] = lax.rsqrt(jnp.var(h.astype(jnp.float32)))
      c = factors[path].astype(y.dtype)
      return c * h if bias is None else c * h + bias

    _intercepting_apply(model, variables, inputs, lambda m: param(m) is not None, on_output,
                        method, apply_kwargs)
    return factors

  factors = jax.jit(factors_of)(variables, inputs)
  params = traverse_util.flatten_dict(variables['params'], keep_empty_nodes=True)
  for path, c in factors.items():
    if not np.isfinite(float(c)):
      raise ValueError(
          f'data_dependent_init: layer {"/".join(path)} has zero (or non-finite) output '
          'variance on the batch; cannot rescale it.')
    key = path + (names[path],)
    params[key] = (params[key] * c).astype(params[key].dtype)
  return {**flax.core.unfreeze(variables), 'params': traverse_util.unflatten_dict(params)}


def variance_analysis(
    model: nn.Module,
    variables: Mapping[str, Any],
    inputs: Any,
    loss_fn: Callable[[Any], jax.Array],
    *,
    layer_types: tuple[type, ...] | None = None,
    method: Callable[..., Any] | str | None = None,
    **apply_kwargs,
) -> list[LayerStats]:
  """Forward and backward variance per layer, in execution order.

  Args:
    model: the Flax module.
    variables: its variables.
    inputs: one minibatch.
    loss_fn: `loss_fn(model_output) -> scalar` (close over the labels).
    layer_types: layers whose outputs count as pre-activations (a reparameterized
      layer, such as `GmPDense`, only as an instance of a reparameterized type); default
      those with a `scaled_param` (Dense, Conv, LCW, CWN, WN).
    method: forwarded to `model.apply`.
    **apply_kwargs: forwarded to `model.apply`.

  Returns:
    one `LayerStats` per layer call.
  """
  own = lambda cls: getattr(cls, 'reparameterized', False)
  counts = (lambda m: scaled_param(m) is not None) if layer_types is None else (
      lambda m: any(isinstance(m, t) and (own(t) or not own(m)) for t in layer_types))
  order: list[str] = []  # execution order, filled while tracing (jit sorts dict keys)

  def outputs_and_grads(variables, inputs):
    outputs: dict[str, jax.Array] = {}

    def record(module, key, y):
      del module
      outputs[key] = y
      order.append(key)
      return y

    _intercepting_apply(model, variables, inputs, counts, record, method, apply_kwargs)

    def loss_of(perturbations):
      def add(module, key, y):
        del module
        return y + perturbations[key]

      out = _intercepting_apply(model, variables, inputs, counts, add, method, apply_kwargs)
      return loss_fn(out)

    grads = jax.grad(loss_of)({k: jnp.zeros_like(v) for k, v in outputs.items()})
    return outputs, grads

  outputs, grads = jax.jit(outputs_and_grads)(variables, inputs)
  stats = []
  for key in order:
    z = np.asarray(outputs[key], np.float64)
    g = np.asarray(grads[key], np.float64)
    stats.append(LayerStats(
        name=key, mean=float(z.mean()), var=float(z.var()), grad_mean=float(g.mean()),
        grad_var=float(g.var()), shift=activation_shift(z),
        unit_means=z.reshape(-1, z.shape[-1]).mean(axis=0)))
  return stats
