"""Training loops the tests share (our own code)."""

from flax import nnx
import jax.numpy as jnp


def nnx_train(model, x, y, steps, tx):
  """`steps` jitted `tx` steps of an NNX model on the squared error in train mode (eval after);
  returns the losses."""
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)
    return loss

  model.train()
  losses = [float(step(model, opt)) for _ in range(steps)]
  model.eval()
  return losses
