"""The Keras training protocol of the small studies, as one jitted `lax.scan` vmapped over members.

Paper 002's reference code trains its toy and UCI models with Keras `fit`:
per epoch the optimizer steps over the epoch's batches, then the callbacks see
the epoch's logs: `ReduceLROnPlateau` (`geoparam.schedules.reduce_on_plateau`)
and `EarlyStopping(restore_best_weights=True)` (`geoparam.schedules.early_stopping`
and `keep_best`), both on one monitored metric (`Protocol.monitor`: the epoch's
mean training `'loss'`, or a metric that `evaluate` computes on any split after
the epoch). `fit` runs that for every member (initialization seed, data split)
of a batch at once: `jax.jit(jax.vmap(run))` over members, `run` one
`lax.scan` over epochs. A member that has stopped is frozen by masking (Keras:
the epoch that triggers the stop still runs), and at the end a member that
stopped early gets its best weights back (Keras 2's `restore_best_weights`).

Optional pieces: `trainable` (a mask of the params that are updated; the others
stay at their initial values), `hook` (a function of the variables recorded
before the first step and after every optimizer step, e.g. the characteristic
points of a layer), `finalize` (a function of the initial and final variables,
e.g. test predictions), all inside the same compiled call.

`train_epochs` is the other loop, for the minibatch classifier studies
(`deep_sigmoid_mlp`, `he_init_depth`) that run minutes to hours: a Python loop
over epochs around one jitted `lax.scan` over the epoch's shuffled batches,
a per-epoch learning-rate rule, evaluation after every epoch and one progress
line per epoch.

Example: two members fit `y = 3 x` by SGD from different starting points.

  >>> import jax, jax.numpy as jnp, optax
  >>> x = jnp.linspace(-1.0, 1.0, 8)[:, None]
  >>> p = Protocol(num_epochs=50, learning_rate=0.5, plateau_patience=5, stop_patience=10)
  >>> def mse(variables, batch, member):
  ...   return jnp.mean((batch * variables['params']['w'] - 3 * batch) ** 2), {}
  >>> out = fit(p, init=lambda w0: {'params': {'w': w0}}, loss=mse, batches=full_batch(x),
  ...           members=jnp.array([[0.0], [5.0]]), optimizer=optax.sgd)
  >>> out['variables']['params']['w'].shape, out['logs']['loss'].shape
  ((2, 1), (2, 50))
  >>> bool(jnp.allclose(out['variables']['params']['w'], 3.0, atol=1e-3))
  True
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from geoparam import masks
from geoparam import schedules


@dataclasses.dataclass(frozen=True)
class Protocol:
  """Settings of the Keras protocol (the reference code's `fit` and callbacks).

  Attributes:
    num_epochs: maximum number of epochs (>= 1).
    learning_rate: initial rate of the optimizer.
    monitor: the logged metric plateau and early stopping watch: `'loss'` (mean
      training loss of the epoch's steps, Keras' `loss`) or a key of `evaluate`'s dict.
    mode: `'min'` or `'max'` (for both callbacks).
    plateau_factor, plateau_patience, plateau_min_delta, plateau_cooldown, min_lr:
      `ReduceLROnPlateau`'s settings (Keras defaults but `patience`).
    stop_patience, stop_min_delta: `EarlyStopping`'s settings.
    restore_best: a member that stops early ends with its best weights.
  """

  num_epochs: int
  learning_rate: float
  monitor: str = 'loss'
  mode: str = 'min'
  plateau_factor: float = 0.1
  plateau_patience: int = 10
  plateau_min_delta: float = 1e-4
  plateau_cooldown: int = 0
  min_lr: float = 0.0
  stop_patience: int = 10
  stop_min_delta: float = 0.0
  restore_best: bool = True

  def schedules(self) -> tuple[schedules.Schedule, schedules.Schedule]:
    """`(plateau, stopper)` (their factories check the settings)."""
    plateau = schedules.reduce_on_plateau(
        factor=self.plateau_factor, patience=self.plateau_patience, mode=self.mode,
        min_delta=self.plateau_min_delta, cooldown=self.plateau_cooldown, min_lr=self.min_lr)
    stopper = schedules.early_stopping(patience=self.stop_patience, mode=self.mode,
                                       min_delta=self.stop_min_delta)
    return plateau, stopper


def full_batch(*arrays) -> Callable:
  """`batches` for full-batch training on `arrays` shared by every member: one step per epoch."""
  batch = arrays[0] if len(arrays) == 1 else tuple(arrays)
  return lambda member, epoch: (jax.tree.map(lambda a: a[None], batch),)


def shuffled_batches(key, epoch, data, batch_size: int) -> tuple:
  """`batches` groups of epoch `epoch` for minibatch training on `data` (a pytree of arrays
  with a leading axis `n`, e.g. `(x, y)` or the indices `jnp.arange(n)`), Keras-style:
  reshuffled by `fold_in(key, epoch)`, `n // batch_size` full batches, then the remainder as
  one smaller step.

  >>> import jax, jax.numpy as jnp
  >>> g = shuffled_batches(jax.random.key(0), 1, jnp.arange(7), 3)
  >>> [a.shape for a in g], sorted(jnp.concatenate([a.ravel() for a in g]).tolist())
  ([(2, 3), (1, 1)], [0, 1, 2, 3, 4, 5, 6])
  """
  n = jax.tree.leaves(data)[0].shape[0]
  full, rest = divmod(n, batch_size)
  perm = jax.random.permutation(jax.random.fold_in(key, epoch), n)
  shuffled, cut = jax.tree.map(lambda a: a[perm], data), full * batch_size
  groups = (jax.tree.map(lambda a: a[:cut].reshape((full, batch_size) + a.shape[1:]), shuffled),)
  return groups + ((jax.tree.map(lambda a: a[cut:][None], shuffled),) if rest else ())


def _split(variables):
  return variables['params'], {k: v for k, v in variables.items() if k != 'params'}


def fit(protocol: Protocol, *, init: Callable, loss: Callable, batches: Callable, members,
        optimizer: Callable = optax.adam, evaluate: Callable | None = None,
        hook: Callable | None = None, finalize: Callable | None = None,
        trainable: Any = None, block: int | None = None,
        chunk: int | None = None, learning_rate: Callable | None = None) -> dict[str, Any]:
  """Trains every member of `members` under the Keras protocol; one compiled call.

  Args:
    protocol: the settings.
    init: `member -> variables` (`{'params': ..., **collections}`, e.g. `batch_stats`).
    loss: `(variables, batch, member) -> (scalar loss, updated collections)`;
      differentiated with respect to `variables['params']`. The collections it
      returns (e.g. BN running statistics) replace the old ones, cast to their dtype.
    batches: `(member, epoch) -> tuple of stacked batches`: each entry a pytree
      whose leading axis is the steps of a group (scanned in order), so an epoch
      of full batches plus a smaller remainder is `(full, remainder[None])`;
      `full_batch(x, y)` for one full-batch step per epoch.
    members: a pytree whose leading axis `(M, ...)` indexes the members
      (initialization keys, data splits, ...), vmapped over.
    optimizer: `learning_rate -> optax.GradientTransformation` (wrapped by
      `optax.inject_hyperparams`, so the plateau rule can set the rate).
    evaluate: `(variables, member) -> dict of scalars`, computed after every
      epoch with the epoch's final weights (Keras' validation metrics).
    hook: `(variables, member) -> pytree`, recorded before the first step and
      after every optimizer step.
    finalize: `(initial_variables, final_variables, member) -> pytree`, computed
      at the end inside the same compiled call (final = after restoring the best).
    trainable: None (all params train), or a pytree of Python bools with the
      structure of the params (or a function `params -> such a pytree`):
      params marked False keep their initial values.
    block: None (one `lax.scan` over all epochs), or epochs per `lax.scan` block
      inside a `lax.while_loop` that ends once every member (of the chunk) has
      stopped: the same results with less work when members stop early. The
      logs of epochs that did not run then repeat the last computed epoch's
      (with `active` False), and `track` repeats the last recorded state.
    chunk: None (all members in one `vmap`), or members per vmapped chunk (a
      divisor of `M`): the chunks run one after another (`lax.map`), which keeps
      a chunk's activations in cache and, with `block`, lets a chunk whose
      members have all stopped end its loop.
    learning_rate: None (every member starts at `protocol.learning_rate`), or
      `member -> initial rate` (a scalar), so a grid of rates trains in the same
      compiled call (members `{'key': ..., 'lr': ...}`, `learning_rate=lambda m: m['lr']`).

  Returns:
    A dict of arrays with a leading member axis `M`: `variables` (final),
    `logs` (per epoch `(M, num_epochs)`: `loss`, `evaluate`'s metrics, `lr` the
    rate the epoch used, `active` whether the epoch ran), `epochs_run`,
    `stopped`, `best_epoch` (0-based, -1 if none improved), `best` (best
    monitored value), `final_lr`, `epochs_computed` (epochs the member's loop
    ran, masked ones included: `num_epochs` without `block`); `track`
    (`(M, steps + 1, ...)`, index 0 the initial state) with a `hook`; `final`
    with a `finalize`.
  """
  plateau, stopper = protocol.schedules()
  lr = protocol.learning_rate
  opt = optax.inject_hyperparams(optimizer)(learning_rate=lr)

  def step(carry, batch, member, active):
    """One optimizer step; a member that has stopped (`~active`) keeps its state."""
    params, others, opt_state = carry

    def loss_fn(p):
      return loss({'params': p, **others}, batch, member)

    (value, updated), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    # Flax keeps BN running statistics in float32; keep their dtype stable in the carry.
    updated = jax.tree.map(lambda n, o: n.astype(o.dtype), updated, others)
    updates, new_opt = opt.update(grads, opt_state, params)
    if trainable is not None:
      mask = trainable(params) if callable(trainable) else trainable
      updates = jax.tree.map(lambda u, m: u if m else jnp.zeros_like(u), updates, mask)
    new = (optax.apply_updates(params, updates), updated, new_opt)
    new = jax.tree.map(lambda n, o: jnp.where(active, n, o), new, carry)
    out = {'loss': value}
    if hook is not None:
      out['track'] = hook({'params': new[0], **new[1]}, member)
    return new, out

  def run(member):
    variables = init(member)
    params, others = _split(variables)
    opt_state, start = opt.init(params), lr
    if learning_rate is not None:
      start = learning_rate(member)
      opt_state = schedules.set_learning_rate(opt_state, start)
    carry = dict(state=(params, others, opt_state), plateau=plateau.init(start),
                 stop=stopper.init(), best=(params, others))

    def epoch(carry, t):
      # Keras: the epoch that triggers the stop still runs.
      active = ~carry['stop'].stop & (t < protocol.num_epochs)
      state, outs = carry['state'], []
      for group in batches(member, t):
        state, out = jax.lax.scan(lambda s, b: step(s, b, member, active), state, group)
        outs.append(out)
      out = jax.tree.map(lambda *a: jnp.concatenate(a), *outs)
      params, others, opt_state = state
      logs = {'loss': jnp.mean(out['loss'])}
      if evaluate is not None:
        logs.update(evaluate({'params': params, **others}, member))
      metric = logs[protocol.monitor]
      plateau_state = plateau.update(carry['plateau'], metric)
      stop_state = stopper.update(carry['stop'], metric)
      new = dict(state=(params, others, schedules.set_learning_rate(opt_state, plateau_state.lr)),
                 plateau=plateau_state, stop=stop_state,
                 best=schedules.keep_best(stop_state.improved, carry['best'], (params, others)))
      new = jax.tree.map(lambda n, o: jnp.where(active, n, o), new, carry)
      logs.update(lr=carry['plateau'].lr, active=active)
      return new, (logs, out.get('track'))

    if block is None:
      carry, (logs, track) = jax.lax.scan(epoch, carry, jnp.arange(protocol.num_epochs))
      computed = jnp.asarray(protocol.num_epochs, jnp.int32)
    else:
      carry, (logs, track), computed = _blocks(epoch, carry, protocol.num_epochs, block)
    current = carry['state'][:2]
    if protocol.restore_best:
      current = jax.tree.map(lambda b, c: jnp.where(carry['stop'].stop, b, c),
                             carry['best'], current)
    final = {'params': current[0], **current[1]}
    stop = carry['stop']
    result = dict(variables=final, logs=logs, epochs_run=jnp.sum(logs['active']),
                  stopped=stop.stop, best_epoch=stop.best_epoch, best=stop.best,
                  final_lr=carry['plateau'].lr, epochs_computed=computed)
    if hook is not None:
      first = hook(variables, member)
      # (epochs, steps per epoch, ...) -> (epochs * steps + 1, ...), index 0 the initial state.
      result['track'] = jax.tree.map(
          lambda a0, a: jnp.concatenate([a0[None], a.reshape((-1,) + a.shape[2:])]), first, track)
    if finalize is not None:
      result['final'] = finalize(variables, final, member)
    return result

  def run_all(members):
    size = jax.tree.leaves(members)[0].shape[0]
    if chunk is None or chunk >= size:
      return jax.vmap(run)(members)
    if size % chunk:
      raise ValueError(f'chunk={chunk} does not divide the {size} members.')
    split = lambda a: a.reshape((size // chunk, chunk) + a.shape[1:])
    out = jax.lax.map(jax.vmap(run), jax.tree.map(split, members))
    return jax.tree.map(lambda a: a.reshape((size,) + a.shape[2:]), out)

  return jax.jit(run_all)(members)


def _blocks(epoch: Callable, carry, num_epochs: int, block: int):
  """`lax.scan(epoch, carry, arange(num_epochs))` as blocks of `block` epochs in a while loop.

  The loop ends at `num_epochs` or once the member has stopped (under `vmap`:
  once every member has); epochs past the end are masked (`epoch`'s `active`).
  Outputs of epochs that did not run repeat the last computed epoch's, with
  `active` False; the per-step outputs (`track`) repeat the last step's.
  """
  if not (isinstance(block, int) and block >= 1):
    raise ValueError(f'block must be an int >= 1, got {block!r}.')
  length = -(-num_epochs // block) * block
  shapes = jax.eval_shape(lambda c: jax.lax.scan(epoch, c, jnp.arange(block))[1], carry)
  buffers = jax.tree.map(lambda a: jnp.zeros((length,) + a.shape[1:], a.dtype), shapes)

  def body(state):
    t, carry, buffers = state
    carry, out = jax.lax.scan(epoch, carry, t + jnp.arange(block))
    buffers = jax.tree.map(lambda b, o: jax.lax.dynamic_update_slice_in_dim(b, o, t, 0),
                           buffers, out)
    return t + block, carry, buffers

  def running(state):
    t, carry, _ = state
    return (t < num_epochs) & ~carry['stop'].stop

  ran, carry, (logs, track) = jax.lax.while_loop(
      running, body, (jnp.zeros((), jnp.int32), carry, buffers))

  def repeat_last(a, written):
    last = jax.lax.dynamic_index_in_dim(a, written - 1, 0, keepdims=False)
    rows = jnp.arange(a.shape[0]).reshape((-1,) + (1,) * (a.ndim - 1))
    return jnp.where(rows < written, a, last)

  logs = jax.tree.map(lambda a: repeat_last(a, ran)[:num_epochs], logs)
  logs['active'] = logs['active'] & (jnp.arange(num_epochs) < ran)
  if track is not None:
    track = jax.tree.map(
        lambda a: repeat_last(a.reshape((-1,) + a.shape[2:]), ran * a.shape[1]).reshape(
            a.shape)[:num_epochs], track)
  return carry, (logs, track), jnp.minimum(ran, num_epochs)


# ---------------------------------------------------------------------------
# Minibatch epochs of a classifier, one jitted epoch at a time.


def masked_sgd(momentum: float, weight_decay: float) -> Callable:
  """`learning_rate -> optax` SGD with momentum and weight decay on kernels and LCW `v` only.

  The decay is `optax.add_decayed_weights` masked by `geoparam.decay_mask` (no
  decay on biases, scales, PReLU slopes), added to the gradient before momentum.
  """
  def make(learning_rate):
    return optax.chain(optax.add_decayed_weights(weight_decay, mask=masks.decay_mask),
                       optax.sgd(learning_rate, momentum=momentum))
  return make


CURVES = ('train_loss', 'train_acc', 'test_loss', 'test_acc', 'lr')


def train_epochs(model, variables, data: Mapping[str, Any], *, num_epochs: int,
                 batch_size: int, learning_rate: float, key, optimizer: Callable,
                 schedule: schedules.Schedule | None = None, eval_chunk: int | None = None,
                 init_train_examples: int = 2000, log: Callable | None = print,
                 label: str = '') -> dict[str, Any]:
  """Trains the classifier `model` on `data` by minibatches; one jitted `lax.scan` per epoch.

  Epoch `e` (1-based) steps through the batches `permutation(fold_in(key, e), n)`
  cut into `n // batch_size` batches of `batch_size` (the remainder is dropped)
  with the softmax cross-entropy; then the test split is evaluated (eval mode:
  running statistics) and the rate moves by `schedule` (per epoch, e.g.
  `geoparam.schedules.per_epoch_decay`; None: constant). One progress line per
  epoch goes to `log`.

  Args:
    model: a linen classifier, `model.apply(variables, x, train=...)` -> logits;
      collections other than `params` (BN/SL running statistics, SN vectors)
      are updated in training mode.
    variables: the initial variables.
    data: `x_train`, `y_train`, `x_test`, `y_test` (integer labels).
    num_epochs, batch_size: the loop.
    learning_rate: the initial rate.
    key: the data-order key.
    optimizer: `learning_rate -> optax.GradientTransformation` (e.g. `masked_sgd`),
      wrapped by `optax.inject_hyperparams` so the schedule can set the rate.
    schedule: the per-epoch rate rule, or None for a constant rate.
    eval_chunk: None (evaluate a split in one call) or examples per evaluated
      chunk (`lax.map`; the last chunk is padded and masked), for large splits.
    init_train_examples: how many training examples (a fixed random subset) are
      evaluated at initialization (epoch 0 of the train curves).
    log: a function taking one line, or None.
    label: what the progress lines start with, e.g. `'[study] method'`.

  Returns:
    `variables` (final), `curves` (`CURVES` -> `num_epochs + 1` floats: index 0
    at initialization, then per epoch the mean training loss and accuracy of its
    steps, the test loss and accuracy after it and the rate it used; `lr` is NaN
    at index 0), `final_*` (the curves' last entries) and `seconds`.
  """
  x_train, y_train = jnp.asarray(data['x_train']), jnp.asarray(data['y_train'])
  x_test, y_test = jnp.asarray(data['x_test']), jnp.asarray(data['y_test'])
  n = len(y_train)
  steps = n // batch_size
  if steps < 1:
    raise ValueError(f'{n} training examples are fewer than one batch ({batch_size}).')
  state = dict(variables)
  params = state.pop('params')
  opt = optax.inject_hyperparams(optimizer)(learning_rate=learning_rate)

  def apply(params, state, x, train):
    if train and state:
      return model.apply({'params': params, **state}, x, train=True, mutable=list(state))
    return model.apply({'params': params, **state}, x, train=train), state

  def loss_fn(params, state, x, y):
    logits, new_state = apply(params, state, x, True)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (new_state, jnp.mean(jnp.argmax(logits, -1) == y))

  @jax.jit
  def run_epoch(params, state, opt_state, key):
    order = jax.random.permutation(key, n)[:steps * batch_size].reshape(steps, batch_size)

    def step(carry, idx):
      params, state, opt_state = carry
      (loss, (state, acc)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          params, state, x_train[idx], y_train[idx])
      updates, opt_state = opt.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), state, opt_state), (loss, acc)

    (params, state, opt_state), (loss, acc) = jax.lax.scan(step, (params, state, opt_state),
                                                           order)
    return params, state, opt_state, jnp.mean(loss), jnp.mean(acc)

  @jax.jit
  def evaluate(params, state, x, y):
    """Mean loss and accuracy in eval mode."""
    if eval_chunk is None:
      logits, _ = apply(params, state, x, False)
      return (optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
              jnp.mean(jnp.argmax(logits, -1) == y))
    m = x.shape[0]
    pad = -m % eval_chunk
    xp = jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)])
    yp = jnp.concatenate([y, jnp.zeros((pad,), y.dtype)])
    w = jnp.concatenate([jnp.ones((m,)), jnp.zeros((pad,))])

    def one(args):
      xb, yb, wb = args
      logits, _ = apply(params, state, xb, False)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
      return jnp.sum(loss * wb), jnp.sum((jnp.argmax(logits, -1) == yb) * wb)

    loss, correct = jax.lax.map(one, (xp.reshape(-1, eval_chunk, *x.shape[1:]),
                                      yp.reshape(-1, eval_chunk), w.reshape(-1, eval_chunk)))
    return jnp.sum(loss) / m, jnp.sum(correct) / m

  t0 = time.perf_counter()
  opt_state = opt.init(params)
  lr_state = schedule.init(learning_rate) if schedule is not None else None
  # A random subset (the unused epoch 0 of the data-order key), not the first rows: data
  # sorted by class (the CIFAR arrays) would score one class.
  init_rows = jax.random.permutation(jax.random.fold_in(key, 0), n)[:init_train_examples]
  init_train = evaluate(params, state, x_train[init_rows], y_train[init_rows])
  init_test = evaluate(params, state, x_test, y_test)
  curves = {k: [float(v)] for k, v in zip(CURVES, (*init_train, *init_test, math.nan))}
  for epoch in range(1, num_epochs + 1):
    lr = learning_rate
    if schedule is not None:
      lr = float(lr_state.lr)
      opt_state = schedules.set_learning_rate(opt_state, lr_state.lr)
    params, state, opt_state, tr_loss, tr_acc = run_epoch(params, state, opt_state,
                                                          jax.random.fold_in(key, epoch))
    te_loss, te_acc = evaluate(params, state, x_test, y_test)
    if schedule is not None:
      lr_state = schedule.update(lr_state)
    for k, v in zip(CURVES, (tr_loss, tr_acc, te_loss, te_acc, lr)):
      curves[k].append(float(v))
    if log is not None:
      log(f'{label} epoch {epoch}/{num_epochs}: train loss {curves["train_loss"][-1]:.4f} acc '
          f'{curves["train_acc"][-1]:.3f}, test loss {curves["test_loss"][-1]:.4f} acc '
          f'{curves["test_acc"][-1]:.3f} (lr {lr:.4g}, {time.perf_counter() - t0:.0f} s)')
  out = dict(variables={'params': params, **state}, curves=curves,
             seconds=time.perf_counter() - t0)
  out.update({f'final_{k}': curves[k][-1] for k in CURVES if k != 'lr'})
  return out


def stalled(train_loss: float, num_classes: int) -> bool:
  """No learning: a training loss within 5% of chance level `ln K` (or not finite)."""
  return not math.isfinite(train_loss) or train_loss > 0.95 * math.log(num_classes)


def plot_epoch_curves(axes, results: Mapping[str, Mapping[str, Any]]) -> None:
  """Train loss (`axes[0]`) and test accuracy (`axes[1]`) per epoch of every run in `results`.

  `results`: run name -> a `train_epochs` result (its `curves`); epoch 0 is the
  initialization; line styles cycle so that overlapping runs stay visible. No legend
  (the caller places one beside the axes).
  """
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top

  for i, (name, r) in enumerate(results.items()):
    c = r['curves']
    style = dict(marker='o', ms=3, ls=('-', '--', '-.', ':')[i % 4], label=name)  # overlaps show
    axes[0].plot(range(len(c['train_loss'])), c['train_loss'], **style)
    axes[1].plot(range(len(c['test_acc'])), c['test_acc'], **style)
  axes[0].set_ylabel('train loss (epoch 0: at init)')
  axes[0].set_title('training loss', fontsize=10)
  axes[1].set_ylabel('test accuracy')
  axes[1].set_title('test accuracy', fontsize=10)
  for ax in axes[:2]:
    ax.set_xlabel('epoch')
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
