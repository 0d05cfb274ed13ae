"""Training loops the tests share, and trained-like variables without training (our own code)."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np


def trained_like(shapes, seed: int = 0):
  """Variables on `shapes` (e.g. `jax.eval_shape` of a model's init; unboxed, dict-keyed) as
  training leaves them, drawn in numpy, so nothing compiles: kernels LeCun normal over all axes
  but the last; BatchNorm/LayerNorm scales of either sign, some near zero (as zero-initialized
  scales become), |scale| in [0.02, 1.5]; variances in [0.5, 1.5]; biases and running means
  N(0, 0.1^2)."""
  rng = np.random.default_rng(seed)

  def draw(path, v):
    name = path[-1].key
    if name == 'kernel':
      value = rng.normal(0.0, 1 / np.sqrt(np.prod(v.shape[:-1])), v.shape)
    elif name == 'scale':
      value = rng.choice([-1.0, 1.0], v.shape) * rng.uniform(0.02, 1.5, v.shape)
    elif name == 'var':
      value = rng.uniform(0.5, 1.5, v.shape)
    else:
      value = rng.normal(0.0, 0.1, v.shape)
    return jnp.asarray(value, v.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def nnx_train(model, x, y, steps, tx, loss=None):
  """`steps` jitted `tx` steps of an NNX model on `loss(model)` (default: the squared error of
  `model(x)` against `y`) in train mode (eval after); returns the losses."""
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  loss = loss or (lambda m: jnp.mean((m(x) - y) ** 2))

  @nnx.jit
  def step(model, opt):
    loss_value, grads = nnx.value_and_grad(loss)(model)
    opt.update(model, grads)
    return loss_value

  model.train()
  losses = [float(step(model, opt)) for _ in range(steps)]
  model.eval()
  return losses
