"""experiments.lib.protocol.fit against a plain-Python Keras reference, member by member under vmap.

The reference is Keras 2's `ReduceLROnPlateau.on_epoch_end` and
`EarlyStopping(restore_best_weights=True).on_epoch_end` written out in plain
Python, driving plain SGD on one weight whose gradient is 1 (so the weight is
minus the sum of the rates of every step: it records the rate history, and the
restored weight tells which epoch was kept). The monitored metric is a scripted
sequence per member, on a grid of 0.25 (exact in float32, so ties are ties).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.lib import protocol

EPOCHS = 40
STEPS = (3, 1)  # two groups of optimizer steps per epoch: a full part and a remainder


class KerasPlateau:
  """keras.callbacks.ReduceLROnPlateau.on_epoch_end (Keras 2), plain Python."""

  def __init__(self, lr, factor, patience, mode, min_delta, cooldown, min_lr):
    self.lr, self.factor, self.patience, self.cooldown, self.min_lr = lr, factor, patience, \
        cooldown, min_lr
    if mode == 'min':
      self.better, self.best = (lambda a, b: a < b - min_delta), math.inf
    else:
      self.better, self.best = (lambda a, b: a > b + min_delta), -math.inf
    self.wait = self.cooldown_counter = 0

  def on_epoch_end(self, current):
    if self.cooldown_counter > 0:
      self.cooldown_counter -= 1
      self.wait = 0
    if self.better(current, self.best):
      self.best = current
      self.wait = 0
    elif not self.cooldown_counter > 0:
      self.wait += 1
      if self.wait >= self.patience:
        if self.lr > np.float32(self.min_lr):
          self.lr = max(np.float32(self.lr) * np.float32(self.factor), np.float32(self.min_lr))
          self.cooldown_counter = self.cooldown
          self.wait = 0


class KerasEarlyStopping:
  """keras.callbacks.EarlyStopping(restore_best_weights=True).on_epoch_end (Keras 2)."""

  def __init__(self, patience, mode, min_delta):
    self.patience = patience
    if mode == 'min':
      self.better, self.best = (lambda a, b: a + min_delta < b), math.inf
    else:
      self.better, self.best = (lambda a, b: a - min_delta > b), -math.inf
    self.wait, self.best_epoch, self.best_weights, self.stop = 0, -1, None, False

  def on_epoch_end(self, epoch, current, weights):
    if self.best_weights is None:
      self.best_weights = weights
    self.wait += 1
    if self.better(current, self.best):
      self.best, self.best_epoch, self.best_weights, self.wait = current, epoch, weights, 0
    if self.wait >= self.patience and epoch > 0:
      self.stop = True
      return self.best_weights  # set_weights(best_weights)
    return weights


def keras_reference(script, w0, p: protocol.Protocol):
  """Plain-Python `fit` of one member: per epoch the steps, then [plateau, early stopping]."""
  plateau = KerasPlateau(np.float32(p.learning_rate), p.plateau_factor, p.plateau_patience,
                         p.mode, p.plateau_min_delta, p.plateau_cooldown, p.min_lr)
  stopper = KerasEarlyStopping(p.stop_patience, p.mode, p.stop_min_delta)
  w, lrs, track = np.float32(w0), [], [np.float32(w0)]
  for epoch in range(p.num_epochs):
    lrs.append(np.float32(plateau.lr))
    for _ in range(sum(STEPS)):
      w = np.float32(w - np.float32(plateau.lr))  # SGD, gradient 1
      track.append(w)
    current = float(script[epoch])
    plateau.on_epoch_end(current)
    w = stopper.on_epoch_end(epoch, current, w)
    if stopper.stop:
      break
  return dict(w=w, lrs=np.array(lrs), epochs_run=len(lrs), stopped=stopper.stop,
              best_epoch=stopper.best_epoch, best=stopper.best, final_lr=np.float32(plateau.lr),
              track=np.array(track))


def scripts(mode, num_members):
  """Metric sequences on a 0.25 grid: member i improves until epoch 6 + 8 i, then flattens into
  noise (so members plateau and stop at different epochs); the last one improves every epoch."""
  rng = np.random.RandomState(0)
  sign = 1.0 if mode == 'min' else -1.0
  out = []
  for i in range(num_members - 1):
    trend = -np.minimum(np.arange(EPOCHS), 6 + 8 * i) * 0.5
    noise = rng.randint(-1, 2, EPOCHS) * 0.25
    out.append(sign * (10.0 + trend + noise))
  out.append(sign * (10.0 - 0.25 * np.arange(EPOCHS)))
  return np.stack(out).astype(np.float32)


@pytest.mark.parametrize('mode, cooldown, min_delta, block, chunk', [
    ('min', 0, 1e-4, None, None), ('max', 2, 0.3, None, None),
    # The while-loop form (blocks of epochs, the last one past num_epochs) and chunked members.
    ('min', 0, 1e-4, 7, None), ('max', 2, 0.3, 3, 1)])
def test_fit_equals_the_keras_reference_per_member(mode, cooldown, min_delta, block, chunk):
  p = protocol.Protocol(num_epochs=EPOCHS, learning_rate=0.5, monitor='val', mode=mode,
                        plateau_factor=0.5, plateau_patience=3, plateau_min_delta=min_delta,
                        plateau_cooldown=cooldown, min_lr=0.01, stop_patience=7,
                        stop_min_delta=min_delta)
  script = scripts(mode, 5)
  w0 = np.linspace(-1.0, 1.0, len(script)).astype(np.float32)
  members = dict(script=jnp.asarray(script), w0=jnp.asarray(w0))

  def init(member):
    return {'params': {'w': member['w0'], 'frozen': member['w0'] + 1},
            'count': {'epochs': jnp.zeros((), jnp.int32)}}

  def loss(variables, batch, member):
    del member
    count = variables['count']['epochs'] + jnp.int32(batch[0] == 1)  # last step of the epoch
    return variables['params']['w'] + variables['params']['frozen'], {
        'count': {'epochs': count}}

  def batches(member, epoch):
    del member, epoch
    return (jnp.zeros((STEPS[0], 1)), jnp.zeros((STEPS[1], 1)).at[-1].set(1.0))

  out = protocol.fit(
      p, init=init, loss=loss, batches=batches, members=members, optimizer=optax.sgd,
      evaluate=lambda v, m: {'val': m['script'][v['count']['epochs'] - 1]},
      hook=lambda v, m: v['params']['w'], trainable={'w': True, 'frozen': False},
      finalize=lambda first, last, m: last['params']['w'] - first['params']['w'],
      block=block, chunk=chunk)
  out = jax.tree.map(np.asarray, out)
  stops = []
  for i in range(len(script)):
    ref = keras_reference(script[i], w0[i], p)
    n = ref['epochs_run']
    stops.append(n)
    assert int(out['epochs_run'][i]) == n, i
    assert bool(out['stopped'][i]) == ref['stopped'], i
    assert int(out['best_epoch'][i]) == ref['best_epoch'], i
    assert float(out['best'][i]) == ref['best'], i
    np.testing.assert_array_equal(out['logs']['active'][i], np.arange(EPOCHS) < n)
    np.testing.assert_allclose(out['logs']['lr'][i, :n], ref['lrs'], rtol=1e-6)
    np.testing.assert_allclose(out['final_lr'][i], ref['final_lr'], rtol=1e-6)
    np.testing.assert_allclose(out['variables']['params']['w'][i], ref['w'], rtol=1e-5, atol=1e-6)
    steps = n * sum(STEPS) + 1
    np.testing.assert_allclose(out['track'][i, :steps], ref['track'], rtol=1e-5, atol=1e-6)
    # A stopped member is frozen: its tracked weight stays at the stopping epoch's value.
    assert np.all(out['track'][i, steps:] == out['track'][i, steps - 1])
    assert out['variables']['params']['frozen'][i] == w0[i] + 1  # trainable=False: untouched
    np.testing.assert_allclose(out['final'][i], ref['w'] - w0[i], rtol=1e-5, atol=1e-6)
  # The scripts exercise the protocol: members stop at different epochs, one runs to the end,
  # and the plateau rule cuts the rate.
  assert len(set(stops)) >= 3 and EPOCHS in stops and min(stops) < EPOCHS // 2
  assert np.any(out['logs']['lr'][:, -1] < 0.5)


def test_blocks_end_once_every_member_has_stopped():
  """With `block`, epochs after every member stopped are not computed (the count shows it)."""
  p = protocol.Protocol(num_epochs=100, learning_rate=0.5, monitor='val', stop_patience=2)
  members = jnp.array([1, 5, 3])  # member i: val improves until epoch m_i, then stays flat

  def loss(variables, batch, member):
    del batch, member
    return 0.0 * variables['params']['w'], {'calls': {'n': variables['calls']['n'] + 1}}

  def run(block, chunk=None):
    return jax.tree.map(np.asarray, protocol.fit(
        p, init=lambda m: {'params': {'w': jnp.zeros(())}, 'calls': {'n': jnp.zeros((), int)}},
        loss=loss, batches=protocol.full_batch(jnp.zeros(1)), members=members,
        evaluate=lambda v, m: {'val': -jnp.minimum(v['calls']['n'], m).astype(jnp.float32)},
        hook=lambda v, m: v['calls']['n'], block=block, chunk=chunk))

  full, blocks, chunks = run(None), run(4), run(4, chunk=1)
  for out in (blocks, chunks):
    for key in ('epochs_run', 'stopped', 'best_epoch', 'best', 'final_lr'):
      np.testing.assert_array_equal(out[key], full[key], err_msg=key)
    np.testing.assert_array_equal(out['logs']['active'], full['logs']['active'])
    np.testing.assert_array_equal(out['track'], full['track'])  # frozen: the count stays
  np.testing.assert_array_equal(full['epochs_run'], [3, 7, 5])
  np.testing.assert_array_equal(full['epochs_computed'], [100, 100, 100])
  # Blocks of 4: each member's loop ends with the block in which it stopped.
  np.testing.assert_array_equal(blocks['epochs_computed'], [4, 8, 8])
  np.testing.assert_array_equal(chunks['epochs_computed'], [4, 8, 8])
  with pytest.raises(ValueError, match='does not divide'):
    run(4, chunk=2)


def test_restore_best_false_keeps_the_last_weights():
  p = protocol.Protocol(num_epochs=12, learning_rate=0.5, monitor='val', stop_patience=2,
                        restore_best=False)
  script = jnp.array([[1.0, 0.5, 0.75, 0.75, 0.75] + [0.75] * 7])
  out = protocol.fit(
      p, init=lambda m: {'params': {'w': jnp.zeros(())}}, members=script, optimizer=optax.sgd,
      loss=lambda v, b, m: (v['params']['w'], {}), batches=protocol.full_batch(jnp.zeros(1)),
      evaluate=lambda v, m: {'val': m[jnp.round(-v['params']['w'] / 0.5).astype(int) - 1]})
  assert int(out['epochs_run'][0]) == 4 and bool(out['stopped'][0])
  assert float(out['variables']['params']['w'][0]) == -2.0  # after 4 steps, not the best (-1)


def softmax_reference(w, b, x, y):
  """Float64 numpy: mean softmax cross-entropy of `x @ w + b`, its gradients and accuracy."""
  logits = x @ w + b
  z = logits - logits.max(axis=1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
  n = len(y)
  loss = -np.mean(np.log(p[np.arange(n), y]))
  d = p.copy()
  d[np.arange(n), y] -= 1.0
  d /= n
  return loss, x.T @ d, d.sum(axis=0), np.mean(logits.argmax(axis=1) == y)


@pytest.mark.parametrize('chunk', [None, 7])
def test_train_epochs_equals_a_plain_python_sgd_loop(chunk):
  """`train_epochs` on a linear softmax classifier against SGD written out step by step.

  The same shuffles (`permutation(fold_in(key, epoch), n)`, remainder dropped), momentum
  0.9, weight decay on the kernel only (`masked_sgd`), the rate x0.5 per epoch down to
  0.03 (`per_epoch_decay`); the curves: epoch 0 at init, then the mean over the epoch's
  steps of the loss and accuracy before each step, and the test metrics after the epoch.
  """
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from geoparam import schedules  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  data = dict(x_train=rng.normal(size=(22, 5)).astype(np.float32),
              y_train=rng.integers(0, 3, 22).astype(np.int32),
              x_test=rng.normal(size=(9, 5)).astype(np.float32),
              y_test=rng.integers(0, 3, 9).astype(np.int32))

  class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
      del train
      return nn.Dense(3, kernel_init=nn.initializers.normal(1.0),
                      bias_init=nn.initializers.normal(1.0), name='dense')(x)

  net = Classifier()
  variables = net.init(jax.random.key(1), data['x_train'][:1])
  key, batch, epochs, lr0, momentum, wd = jax.random.key(7), 4, 3, 0.2, 0.9, 0.01
  out = protocol.train_epochs(
      net, variables, data, num_epochs=epochs, batch_size=batch, learning_rate=lr0, key=key,
      optimizer=protocol.masked_sgd(momentum, wd),
      schedule=schedules.per_epoch_decay(0.5, 0.03), eval_chunk=chunk, init_train_examples=10,
      log=None)

  p = variables['params']['dense']
  w, b = np.asarray(p['kernel'], np.float64), np.asarray(p['bias'], np.float64)
  tw, tb = np.zeros_like(w), np.zeros_like(b)  # momentum traces
  x, y = data['x_train'].astype(np.float64), data['y_train']
  xt, yt = data['x_test'].astype(np.float64), data['y_test']
  rows = np.asarray(jax.random.permutation(jax.random.fold_in(key, 0), 22))[:10]  # at init
  loss0, _, _, acc0 = softmax_reference(w, b, x[rows], y[rows])
  test0, _, _, tacc0 = softmax_reference(w, b, xt, yt)
  curves = dict(train_loss=[loss0], train_acc=[acc0], test_loss=[test0], test_acc=[tacc0],
                lr=[math.nan])
  lr = lr0
  for epoch in range(1, epochs + 1):
    order = np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), 22))
    losses, accs = [], []
    for s in range(22 // batch):
      idx = order[s * batch:(s + 1) * batch]
      loss, gw, gb, acc = softmax_reference(w, b, x[idx], y[idx])
      losses.append(loss)
      accs.append(acc)
      tw = (gw + wd * w) + momentum * tw  # decay on the kernel only, before momentum
      tb = gb + momentum * tb
      w, b = w - lr * tw, b - lr * tb
    test, _, _, tacc = softmax_reference(w, b, xt, yt)
    for k, v in zip(protocol.CURVES, (np.mean(losses), np.mean(accs), test, tacc, lr)):
      curves[k].append(v)
    lr = max(lr * 0.5, 0.03)

  for k in protocol.CURVES:
    np.testing.assert_allclose(out['curves'][k], curves[k], rtol=2e-5, atol=1e-6, err_msg=k)
  final = out['variables']['params']['dense']
  np.testing.assert_allclose(final['kernel'], w, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(final['bias'], b, rtol=2e-5, atol=1e-6)
  assert out['final_test_acc'] == out['curves']['test_acc'][-1] and len(curves['lr']) == 4
  with pytest.raises(ValueError, match='fewer than one batch'):
    protocol.train_epochs(net, variables, data, num_epochs=1, batch_size=23, learning_rate=0.1,
                          key=key, optimizer=protocol.masked_sgd(0.9, 0.0), log=None)


def test_a_vmapped_grid_of_learning_rates_equals_the_cells_fitted_one_by_one():
  """`fit(learning_rate=member -> rate)`: a grid of rates x initial scales in one compiled call
  gives, cell by cell, what `Protocol(learning_rate=rate)` gives alone (float64, Adam, plateau
  and early stopping active, one rate large enough to diverge)."""
  with jax.enable_x64(True):
    x = jnp.linspace(-1.0, 1.0, 16, dtype=jnp.float64)[:, None]
    y = jnp.sin(3.0 * x)

    def init(member):
      k1, k2 = jax.random.split(member['key'])
      return {'params': {'w': member['scale'] * jax.random.normal(k1, (1, 8), jnp.float64),
                         'v': jax.random.normal(k2, (8, 1), jnp.float64)}}

    def mse(variables, batch, member):
      p = variables['params']
      return jnp.mean((jnp.tanh(batch[0] @ p['w']) @ p['v'] - batch[1]) ** 2), {}

    rates, scales = [3e-2, 3.0], [0.1, 10.0]
    cells = [(r, s) for r in rates for s in scales]
    key = jax.random.PRNGKey(0)
    grid = protocol.fit(
        protocol.Protocol(num_epochs=30, learning_rate=1.0, plateau_patience=3, stop_patience=6),
        init=init, loss=mse, batches=protocol.full_batch(x, y),
        members={'key': jnp.stack([key] * len(cells)),
                 'lr': jnp.array([r for r, _ in cells], jnp.float64),
                 'scale': jnp.array([s for _, s in cells], jnp.float64)},
        learning_rate=lambda m: m['lr'])
    for i, (rate, scale) in enumerate(cells):
      alone = protocol.fit(
          protocol.Protocol(num_epochs=30, learning_rate=rate, plateau_patience=3,
                            stop_patience=6),
          init=init, loss=mse, batches=protocol.full_batch(x, y),
          members={'key': key[None], 'scale': jnp.array([scale], jnp.float64)})
      np.testing.assert_allclose(grid['logs']['loss'][i], alone['logs']['loss'][0],
                                 rtol=1e-9, err_msg=f'cell lr={rate}, scale={scale}')
      np.testing.assert_array_equal(grid['logs']['lr'][i], alone['logs']['lr'][0])
      assert int(grid['epochs_run'][i]) == int(alone['epochs_run'][0])
    # The grid really differs across cells (the rate is not ignored).
    assert len({round(float(v), 9) for v in grid['logs']['loss'][:, -1]}) == len(cells)


def test_train_epochs_scores_init_on_a_random_subset_of_class_sorted_data():
  """Epoch 0 of the train curves evaluates `init_train_examples` random rows: on data sorted
  by class (the CIFAR arrays) the first rows are one class, and a net that predicts class 0
  everywhere would read 100% accuracy there instead of about half."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  data = dict(x_train=np.ones((200, 3), np.float32),
              y_train=np.repeat([0, 1], 100).astype(np.int32),
              x_test=np.ones((4, 3), np.float32), y_test=np.array([0, 1, 0, 1], np.int32))

  class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
      del train  # zero kernel and bias: logits 0, argmax class 0, loss ln 2
      return nn.Dense(2, kernel_init=nn.initializers.zeros)(x)

  model = Classifier()
  out = protocol.train_epochs(model, model.init(jax.random.key(0), data['x_train'][:1]), data,
                              num_epochs=1, batch_size=50, learning_rate=0.0,
                              key=jax.random.key(3), optimizer=protocol.masked_sgd(0.0, 0.0),
                              init_train_examples=40, log=None)
  assert 0.25 < out['curves']['train_acc'][0] < 0.75, out['curves']['train_acc'][0]
  np.testing.assert_allclose(out['curves']['train_loss'][0], np.log(2), rtol=1e-6)
