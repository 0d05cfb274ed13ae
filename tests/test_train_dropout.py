"""The train step feeds a deterministic dropout rng (VGG19's dropout needs one)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from experiments.vision import train
from experiments.configs import cifar10_cnn


class _DropoutNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = False):
    x = x.reshape((x.shape[0], -1))
    x = nn.Dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(8)(x)))
    return nn.Dense(3)(x)


def test_dropout_rng_is_fed_and_deterministic():
  config = cifar10_cnn.get_config('smoke')
  model = _DropoutNet()
  tx = train.create_optimizer(config)
  state = train.init_state(config, model, tx, (4, 4, 3), jax.random.key(0))
  batch = {'image': jnp.arange(2 * 4 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 4, 3) % 255,
           'label': jnp.array([0, 2]), 'mask': jnp.ones((2,))}
  mean_std = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
  outs = []
  for seed in (0, 0, 1):
    step = jax.jit(train.make_train_step(model, tx, mean_std, seed))
    new_state, _ = step(state, batch)
    outs.append(np.asarray(new_state.params['Dense_0']['kernel']))
  np.testing.assert_array_equal(outs[0], outs[1])  # same seed, same masks
  assert not np.array_equal(outs[0], outs[2])  # another seed, other masks
