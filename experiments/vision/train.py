"""Classification training on any number of devices and hosts: `train_and_evaluate(config, workdir)`.

The shape of flax's `examples/imagenet` and big_vision's `train.py`:

- the train state (params, optional `batch_stats` of BN/MBN/IMN, optimizer
  state, LR-schedule and early-stopping states, the epoch's running metric
  sums, step and epoch counters) is ONE pytree of arrays, created by
  `jax.jit(init, out_shardings=...)` on a `Mesh`, shapes from `jax.eval_shape`;
- FSDP-style feature-axis sharding over the mesh's optional `model` axis
  (`experiments/vision/sharding.py`): every parameter is stored split along its
  last (output-features) axis, or as its `nn.with_partitioning` metadata
  says, the optimizer moments like their parameters, `batch_stats` by the
  same last-axis rule, scalars replicated; the step all-gathers parameters
  and statistics before use. Without a `model` axis: plain data parallelism;
- the step is `jax.jit(step, in_shardings, out_shardings, donate_argnums=0)`
  on a batch sharded over the mesh's `data` axis (only), assembled from each
  process's part with `jax.make_array_from_process_local_data`; BN/MBN/IMN
  means are therefore over the global batch;
- after every epoch: evaluation (top-1/top-5/loss), the LR rule
  (`geoparam.schedules.reduce_on_plateau` on eval top-1, or `per_epoch_decay`,
  or constant), early stopping, a line in `metrics.jsonl`/`metrics.csv`, the
  `last` checkpoint (and `best` when the monitored metric improved);
- SIGTERM saves the last checkpoint mid-epoch and returns; a rerun with the
  same workdir continues exactly (the data order is a function of the seed and
  the epoch, and the resumed epoch skips the batches already done);
- a NaN/inf training loss stops the run with `FloatingPointError`, writes what
  happened to `metrics.jsonl` and `failure.json`, and leaves the last good
  checkpoint untouched.

Files in `workdir`: `config.json`, `metrics.jsonl`, `metrics.csv` (the per-epoch
stream), `results.json/csv/md` (`experiments.lib.report.write`, like every study's: the
summary, the last and best states' evaluation), `checkpoints/{last,best}/`.
"""

from __future__ import annotations

import csv
import functools
import itertools
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from experiments.vision import checkpoints as ckpt_lib
from experiments.vision import augmentation
from experiments.vision import loader as loader_lib
from experiments.vision import sources as sources_lib
from experiments.lib import models
from experiments.lib import report
from experiments.vision import sharding
from experiments.vision import models as vision_models
from experiments.configs import validate
from geoparam import masks
from geoparam import schedules

SUM_KEYS = ('loss', 'top1', 'top5', 'count')


def _methods_of(config) -> tuple[str, ...]:
  """The parameterizations the config's `model` accepts."""
  model = config.get('model', 'cnn')
  if model in ('resnet50', 'resnet'):
    return vision_models.RESNET_PARAMETERIZATIONS
  if model in ('vgg19', 'preact_resnet18'):
    return vision_models.CIFAR_PARAMETERIZATIONS
  return models.METHODS


# The trainer's own config fields (the others are validate.RULES').
CONFIG_RULES = {
    'dataset': validate.choice(sources_lib.DATASETS),
    'augment': validate.choice(validate.AUGMENTS),
    'model': validate.choice(vision_models.MODELS),
    'method': validate.choice(_methods_of),
    'layers': validate.layer_spec,
    'width': validate.POSITIVE_REAL,  # channel multiplier
}


def check_data(config) -> None:
  """Raises `validate.ConfigError` unless `config.dataset` can be opened as the run will."""
  validate.check_vision_data(config)


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # () int32, optimizer steps done
  epoch: jax.Array  # () int32, epochs finished
  params: Any
  batch_stats: Any  # {} when the model has none
  opt_state: Any
  lr_state: Any  # schedules.PlateauState or schedules.DecayState
  stop_state: schedules.EarlyStoppingState
  sums: dict[str, jax.Array]  # running sums of the current epoch's training metrics


# ---------------------------------------------------------------------------
# Pieces: model, optimizer, schedules, steps.


def create_model(config, num_classes: int) -> nn.Module:
  """The config's model (`config.model` in `vision_models.MODELS`, e.g. cnn, vgg6, resnet50)."""
  return vision_models.create_model(config, num_classes)


def create_optimizer(config) -> optax.GradientTransformation:
  """SGD (momentum) or Adam with masked, coupled weight decay; LR injectable."""
  names = tuple(config.decay_names)

  def make(learning_rate):
    if config.optimizer == 'sgd':
      opt = optax.sgd(learning_rate, momentum=config.momentum or None, nesterov=config.nesterov)
    elif config.optimizer == 'adam':
      opt = optax.adam(learning_rate)
    else:
      raise ValueError(f"optimizer must be 'sgd' or 'adam', got {config.optimizer!r}.")
    if not config.weight_decay:
      return opt
    decay = optax.add_decayed_weights(
        config.weight_decay, mask=functools.partial(masks.decay_mask, decayed_names=names))
    return optax.chain(decay, opt)

  return optax.inject_hyperparams(make)(learning_rate=config.learning_rate)


def lr_schedule(config) -> schedules.Schedule:
  if config.lr_schedule == 'plateau':
    return schedules.reduce_on_plateau(
        factor=config.plateau_factor, patience=config.plateau_patience, mode=config.monitor_mode,
        min_delta=config.plateau_min_delta, cooldown=config.plateau_cooldown,
        min_lr=config.min_lr)
  if config.lr_schedule == 'decay':
    return schedules.per_epoch_decay(factor=config.decay_factor, min_lr=config.min_lr)
  if config.lr_schedule == 'constant':
    return schedules.per_epoch_decay(factor=1.0, min_lr=0.0)
  raise ValueError(
      f"lr_schedule must be 'plateau', 'decay' or 'constant', got {config.lr_schedule!r}.")


def stop_schedule(config) -> schedules.Schedule:
  patience = config.stop_patience if config.stop_patience > 0 else 2**30
  return schedules.early_stopping(patience=patience, mode=config.monitor_mode,
                                  min_delta=config.stop_min_delta)


def init_variables(model, image_shape, rng):
  """`model.init` on one zero image; leaves are `nn.Partitioned` where the model says so."""
  return model.init(rng, jnp.zeros((1,) + tuple(image_shape), jnp.float32), train=False)


def init_state(config, model, tx, image_shape, rng) -> TrainState:
  variables = nn.unbox(init_variables(model, image_shape, rng))
  params = variables['params']
  batch_stats = variables.get('batch_stats', {})
  zero = jnp.zeros((), jnp.int32)
  return TrainState(
      step=zero, epoch=zero, params=params, batch_stats=batch_stats, opt_state=tx.init(params),
      lr_state=lr_schedule(config).init(config.learning_rate),
      stop_state=stop_schedule(config).init(),
      sums={k: jnp.zeros((), jnp.float32) for k in SUM_KEYS})


def _normalize(images, mean_std):
  """uint8 images (0..255), or float images already in [0, 1] -> normalized float32."""
  mean, std = (jnp.asarray(v, jnp.float32) for v in mean_std)
  if jnp.issubdtype(images.dtype, jnp.integer):
    images = images.astype(jnp.float32) / 255.0
  return (images.astype(jnp.float32) - mean) / std


def _metric_sums(logits, labels, mask):
  """Masked sums of loss, top-1 and top-5 hits, and the number of examples."""
  loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  k = min(5, logits.shape[-1])
  topk = jax.lax.top_k(logits, k)[1]
  hits = topk == labels[:, None]
  return {'loss': jnp.sum(loss * mask), 'top1': jnp.sum(hits[:, 0] * mask),
          'top5': jnp.sum(jnp.any(hits, axis=-1) * mask), 'count': jnp.sum(mask)}


def make_train_step(model, tx, mean_std, seed: int = 0, mesh=None) -> Callable:
  """`(state, batch) -> (state, step_loss)`; the model's `batch_stats` are updated.

  Dropout (if the model has any) draws from `fold_in(key(seed), step)`: deterministic
  and the same after a resume. With a `mesh`, parameters and statistics are gathered
  (replicated) before use, the FSDP all-gather; their gradients and updates are
  resharded by the step's `out_shardings`.
  """
  gather = (lambda t: t) if mesh is None else functools.partial(sharding.gather_params,
                                                                mesh=mesh)

  def step(state: TrainState, batch):
    images = batch['image']
    if 'colour' in batch:  # augment='imagenet': colour jitter and lighting run here, batched
      images = augmentation.colour_lighting(images, batch['colour'])
    x = _normalize(images, mean_std)
    labels, mask = batch['label'], batch['mask']
    has_stats = bool(jax.tree.leaves(state.batch_stats))

    rngs = {'dropout': jax.random.fold_in(jax.random.key(seed), state.step)}

    def loss_fn(params):
      variables = {'params': gather(params)}
      if has_stats:
        variables['batch_stats'] = gather(state.batch_stats)
        logits, new = model.apply(variables, x, train=True, mutable=['batch_stats'], rngs=rngs)
      else:
        logits, new = model.apply(variables, x, train=True, rngs=rngs), {}
      loss = optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), labels)
      loss = jnp.sum(loss * mask) / jnp.maximum(jnp.sum(mask), 1.0)
      return loss, (logits, new.get('batch_stats', state.batch_stats))

    (loss, (logits, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    m = _metric_sums(logits, labels, mask)
    sums = {k: state.sums[k] + m[k] for k in SUM_KEYS}
    new_state = state.replace(step=state.step + 1, params=params, batch_stats=batch_stats,
                              opt_state=opt_state, sums=sums)
    return new_state, loss

  return step


def make_eval_step(model, mean_std, mesh=None) -> Callable:
  """`(state, batch, acc) -> acc`, masked metric sums accumulated over the eval set."""
  gather = (lambda t: t) if mesh is None else functools.partial(sharding.gather_params,
                                                                mesh=mesh)

  def step(state: TrainState, batch, acc):
    variables = {'params': gather(state.params)}
    if jax.tree.leaves(state.batch_stats):
      variables['batch_stats'] = gather(state.batch_stats)
    logits = model.apply(variables, _normalize(batch['image'], mean_std), train=False)
    m = _metric_sums(logits, batch['label'], batch['mask'])
    return {k: acc[k] + m[k] for k in SUM_KEYS}

  return step


def make_end_of_epoch(config, tx) -> Callable:
  """`(state, monitored metric) -> state`: LR rule, early stopping, new LR, reset sums."""
  lr_rule, stopper = lr_schedule(config), stop_schedule(config)
  del tx

  def end(state: TrainState, metric):
    lr_state = lr_rule.update(state.lr_state, metric)
    stop_state = stopper.update(state.stop_state, metric)
    opt_state = schedules.set_learning_rate(state.opt_state, lr_state.lr)
    return state.replace(epoch=state.epoch + 1, lr_state=lr_state, stop_state=stop_state,
                         opt_state=opt_state, sums=jax.tree.map(jnp.zeros_like, state.sums))

  return end


def state_shardings(mesh, state_shapes: TrainState, boxed_params) -> TrainState:
  """NamedShardings of the train state (see `experiments/vision/sharding.py` for the scheme).

  `boxed_params`: the `params` of `jax.eval_shape(init_variables, ...)`, whose
  `nn.Partitioned` boxes carry the model's partitioning metadata.
  """
  params = sharding.param_shardings(mesh, boxed_params)
  rest = sharding.mirror_shardings(mesh, state_shapes.replace(params=None),
                                   state_shapes.params, params)
  return rest.replace(params=params)


class Trainer:
  """The jitted, sharded functions of one configuration on one mesh."""

  def __init__(self, config, mesh, num_classes: int, mean_std, image_shape):
    self.config, self.mesh = config, mesh
    self.model = create_model(config, num_classes)
    self.tx = create_optimizer(config)
    rng = jax.random.key(config.seed)
    init = functools.partial(init_state, config, self.model, self.tx, image_shape)
    with jax.threefry_partitionable(False):
      self.state_shapes = jax.eval_shape(init, rng)
      boxed = jax.eval_shape(
          functools.partial(init_variables, self.model, image_shape), rng)['params']
    self.state_sharding = state_shardings(mesh, self.state_shapes, boxed)
    self.rep = sharding.replicated(mesh)
    batch_sh = sharding.batch_sharding(mesh)
    self.init = jax.jit(init, out_shardings=self.state_sharding)
    self.train_step = jax.jit(
        make_train_step(self.model, self.tx, mean_std, self.config.seed, mesh),
        in_shardings=(self.state_sharding, batch_sh), out_shardings=(self.state_sharding, self.rep),
        donate_argnums=(0,))
    self.eval_step = jax.jit(
        make_eval_step(self.model, mean_std, mesh),
        in_shardings=(self.state_sharding, batch_sh, self.rep), out_shardings=self.rep,
        donate_argnums=(2,))
    self.end_of_epoch = jax.jit(
        make_end_of_epoch(config, self.tx), in_shardings=(self.state_sharding, self.rep),
        out_shardings=self.state_sharding, donate_argnums=(0,))
    self.abstract_state = ckpt_lib.abstract(self.state_shapes, self.state_sharding)

  def new_state(self):
    # The non-partitionable threefry compiles ~5x faster on CPU (12 s -> 2.7 s for a small
    # CNN's init, measured here). Its values do not depend on the mesh either (a run on
    # (2, 4) starts where one on (8,) does); it just cannot split the generation, so each
    # device draws a whole parameter and keeps its slice: init time, not results.
    with jax.threefry_partitionable(False):
      return self.init(jax.random.key(self.config.seed))

  def zero_acc(self):
    return jax.device_put({k: np.zeros((), np.float32) for k in SUM_KEYS}, self.rep)


# ---------------------------------------------------------------------------
# Observability.
#
# Written here, not taken from clu as flax's examples do: clu 0.0.12 (the newest on PyPI)
# imports TensorFlow when `clu.metric_writers` is imported, and `clu.periodic_actions`
# (ReportProgress) imports that package, so neither imports without TensorFlow. With it
# (tensorflow 2.21 alone is 1.9 GB installed, plus tensorboard) the import took 4.1-4.4 s and
# 740 MB RSS, against 1.1 s and 169 MB for jax, flax and optax. ReportProgress would not print
# our line anyway (epoch, loss, img/s, epoch ETA): it logs steps/s and an overall ETA.
# Preemption: `jax.experimental.multihost_utils.reached_preemption_sync_point` (and orbax's
# `reached_preemption`, which calls it) returns False unless jax.distributed is initialized,
# so one-process runs would still need this SIGTERM flag.


def _fmt_time(seconds: float) -> str:
  if not math.isfinite(seconds):
    return '?'
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f'{h}:{m:02d}:{s:02d}' if h else f'{m}:{s:02d}'


class Progress:
  """Text progress lines with throughput and ETA (process 0 prints)."""

  def __init__(self, steps_per_epoch: int, num_epochs: int, batch_size: int, enabled: bool):
    self.steps_per_epoch, self.num_epochs, self.batch_size = steps_per_epoch, num_epochs, batch_size
    self.enabled = enabled
    self.t0 = time.time()
    self.mark = None  # (time, step) after the first (compiling) step of a run

  def line(self, step: int, epoch: int, loss: float, start_step: int):
    now = time.time()
    if self.mark is None or step <= self.mark[1]:
      self.mark = (now, step)
      rate = float('nan')
    else:
      rate = (step - self.mark[1]) / max(now - self.mark[0], 1e-9)
    in_epoch = step - epoch * self.steps_per_epoch
    epoch_left = (self.steps_per_epoch - in_epoch) / rate if rate > 0 else float('nan')
    run_left = (self.steps_per_epoch * self.num_epochs - step) / rate if rate > 0 else float('nan')
    if self.enabled:
      pct = 100.0 * in_epoch / self.steps_per_epoch
      speed = (f'{rate * self.batch_size:7.1f} img/s {rate:6.2f} steps/s' if rate > 0
               else 'compiling/first step')
      print(f'epoch {epoch + 1}/{self.num_epochs} step {in_epoch}/{self.steps_per_epoch} '
            f'({pct:3.0f}%) loss {loss:.4f} | {speed} | elapsed {_fmt_time(now - self.t0)} '
            f'ETA epoch {_fmt_time(epoch_left)} run<= {_fmt_time(run_left)}', flush=True)
    del start_step


def resume_message(step: int, epochs_done: int, steps_per_epoch: int, num_epochs: int) -> str:
  """The line printed when a run resumes, counting epochs as the progress lines do (from 1).

  `epochs_done` is the checkpoint's `state.epoch` (epochs completed); the next progress line
  reads `epoch {epochs_done + 1}/{num_epochs} step k/{steps_per_epoch}`.

  >>> resume_message(390, 1, 390, 10)
  'resumed from step 390: after epoch 1/10, continuing with epoch 2/10 at step 0/390'
  >>> resume_message(500, 1, 390, 10)
  'resumed from step 500: in epoch 2/10, at step 110/390'
  >>> resume_message(3900, 10, 390, 10)
  'resumed from step 3900: after epoch 10/10, the last one'
  """
  in_epoch = step - epochs_done * steps_per_epoch
  head = f'resumed from step {step}: '
  if in_epoch:
    return head + f'in epoch {epochs_done + 1}/{num_epochs}, at step {in_epoch}/{steps_per_epoch}'
  if epochs_done >= num_epochs:
    return head + f'after epoch {epochs_done}/{num_epochs}, the last one'
  return head + (f'after epoch {epochs_done}/{num_epochs}, continuing with epoch '
                 f'{epochs_done + 1}/{num_epochs} at step 0/{steps_per_epoch}')


class MetricsWriter:
  """Appends one JSON object per epoch/event to metrics.jsonl, epochs to metrics.csv, and
  numeric epoch metrics as TensorBoard scalars under `tensorboard/` (tensorboardX, a
  pure-Python event writer: flax's own SummaryWriter needs TensorFlow)."""

  def __init__(self, workdir: str, enabled: bool):
    self.enabled = enabled
    self.jsonl = os.path.join(workdir, 'metrics.jsonl')
    self.csv = os.path.join(workdir, 'metrics.csv')
    self.tensorboard_dir = os.path.join(workdir, 'tensorboard')
    self._tb = None

  def truncate_after(self, epoch: int):
    """Drops records of epochs > `epoch` (written before a crash the checkpoint does not cover)."""
    if not self.enabled or not os.path.exists(self.jsonl):
      return
    with open(self.jsonl) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r.get('epoch', 0) <= epoch]
    with open(self.jsonl, 'w') as f:
      for r in rows:
        f.write(json.dumps(r) + '\n')
    self._rewrite_csv([r for r in rows if 'event' not in r])

  def _rewrite_csv(self, rows):
    if not rows:
      if os.path.exists(self.csv):
        os.remove(self.csv)
      return
    keys = list(rows[0])
    with open(self.csv, 'w', newline='') as f:
      w = csv.DictWriter(f, fieldnames=keys, extrasaction='ignore')
      w.writeheader()
      w.writerows(rows)

  def write(self, record: dict):
    if not self.enabled:
      return
    with open(self.jsonl, 'a') as f:
      f.write(json.dumps(record) + '\n')
    if 'event' in record:
      return
    new = not os.path.exists(self.csv)
    with open(self.csv, 'a', newline='') as f:
      w = csv.DictWriter(f, fieldnames=list(record), extrasaction='ignore')
      if new:
        w.writeheader()
      w.writerow(record)
    self._tensorboard(record)

  def _tensorboard(self, record: dict):
    if self._tb is None:
      try:
        import tensorboardX  # pylint: disable=g-import-not-at-top
      except ImportError:
        self._tb = False
        print('tensorboardX is not installed (pip install geoparam[experiments]); '
              'metrics go to metrics.jsonl/csv only.', flush=True)
      else:
        self._tb = tensorboardX.SummaryWriter(self.tensorboard_dir)
    if not self._tb:
      return
    step = int(record.get('epoch', 0))
    for key, value in record.items():
      if key != 'epoch' and isinstance(value, (int, float)) and not isinstance(value, bool):
        self._tb.add_scalar(key, value, step)
    self._tb.flush()


class _Preemption:
  """SIGTERM -> a flag the loop polls (installed only from the main thread)."""

  def __init__(self):
    self.flag = threading.Event()
    self.previous = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self.previous = signal.signal(signal.SIGTERM, lambda *_: self.flag.set())
    return self

  def __exit__(self, *exc):
    if self.previous is not None:
      signal.signal(signal.SIGTERM, self.previous)

  def requested(self, step: int, every: int) -> bool:
    if jax.process_count() == 1:
      return self.flag.is_set()
    if step % every:  # all processes must agree: a collective every `every` steps
      return False
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    flags = multihost_utils.process_allgather(np.asarray(self.flag.is_set()))
    return bool(np.any(flags))


def _scalars(tree) -> dict[str, float]:
  return {k: float(v) for k, v in sharding.to_host(tree).items()}


def _rates(sums: dict[str, float], prefix: str, examples: int) -> dict[str, float]:
  """Mean loss and accuracies over the counted examples; `{prefix}_skipped`: of `examples`,
  those masked out because their image could not be decoded (`loader_lib.Loader`)."""
  n = max(sums['count'], 1.0)
  return {f'{prefix}_loss': sums['loss'] / n, f'{prefix}_top1': sums['top1'] / n,
          f'{prefix}_top5': sums['top5'] / n,
          f'{prefix}_skipped': int(round(examples - sums['count']))}


def evaluate(trainer: Trainer, state, loader, mesh, batches=None) -> dict[str, float]:
  """Eval metrics over one pass of `loader` (its next `steps_per_epoch` batches of `batches`,
  an iterator of `loader.iterate()` kept across passes, or a fresh pass)."""
  acc = trainer.zero_acc()
  if batches is None:
    batches = loader.epoch(0)
  for batch in itertools.islice(batches, loader.steps_per_epoch):
    acc = trainer.eval_step(state, sharding.global_batch(batch, mesh), acc)
  return _rates(_scalars(acc), 'eval', len(loader.source))


# ---------------------------------------------------------------------------
# The loop.


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
  """Trains and evaluates `config` in `workdir`, resuming from its last checkpoint.

  Args:
    config: see `experiments/configs/cifar10_cnn.py` for the fields.
    workdir: results and checkpoints go here (created if needed).
    on_step: optional host callback with the global step after each step (tests use it to
      send SIGTERM at a chosen step).

  Returns:
    The summary (also in `workdir/results.json`), plus `state` (the last train state)
    and `best_state` (the restored best checkpoint, None without one).
  """
  t_start = time.time()
  main = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  if main:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True))

  mesh = sharding.make_mesh(tuple(config.mesh_shape))
  sharding.check_batch_size(config.batch_size, mesh)
  sharding.check_batch_size(config.eval_batch_size, mesh, 'eval_batch_size')
  sources = sources_lib.get_sources(config)
  pcount, pindex = jax.process_count(), jax.process_index()
  train_loader = loader_lib.Loader(
      sources.train, config.batch_size, train=True, augment=augmentation.make_augment(config, True),
      seed=config.seed, process_index=pindex, process_count=pcount,
      num_workers=config.num_workers, num_threads=config.num_threads, prefetch=config.prefetch)
  eval_loader = loader_lib.Loader(
      sources.eval, config.eval_batch_size, train=False,
      augment=augmentation.make_augment(config, False), seed=config.seed,
      process_index=pindex, process_count=pcount, num_workers=config.num_workers,
      num_threads=config.num_threads, prefetch=config.prefetch)
  # One grain iterator per loader for the whole run (worker processes start once).
  eval_batches = eval_loader.iterate(0)
  image_shape = eval_loader.batch_at(0)['image'].shape[1:]
  trainer = Trainer(config, mesh, sources.num_classes, sources.mean_std, image_shape)
  steps_per_epoch = train_loader.steps_per_epoch

  ckpts = ckpt_lib.Checkpoints(workdir)
  writer = MetricsWriter(workdir, main)
  # The training batches: one grain iterator over the run's records (epoch * steps_per_epoch +
  # step); a checkpoint puts it back at its saved grain state (or, for one written before the
  # data item existed, it restarts at the checkpoint's step).
  train_batches = train_loader.iterate(0, 0, config.num_epochs)
  state = ckpts.restore_last(trainer.abstract_state, data=train_batches)
  if state is None:
    state = trainer.new_state()
    writer.truncate_after(0)
    resumed = False
  else:
    resumed = True
    writer.truncate_after(int(sharding.to_host(state.epoch)))
  step, epoch = int(sharding.to_host(state.step)), int(sharding.to_host(state.epoch))
  if resumed and main:
    print(resume_message(step, epoch, steps_per_epoch, config.num_epochs), flush=True)
  position = train_batches.get_state().get('next_index', step) if ckpts.data_restored else step
  if step - epoch * steps_per_epoch > steps_per_epoch or position != step:
    raise ValueError(
        f'checkpoint at step {step}, epoch {epoch} (data iterator at record {position}) does not '
        f'match {steps_per_epoch} steps per epoch: batch_size or train_examples changed since it '
        'was written.')
  if resumed and not ckpts.data_restored:
    train_batches = train_loader.iterate(epoch, step - epoch * steps_per_epoch, config.num_epochs)
  if main:
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.state_shapes.params))
    print(f'{config.dataset}: {len(sources.train)} train / {len(sources.eval)} eval examples, '
          f'{sources.num_classes} classes, images {tuple(image_shape)}; model {config.model} '
          f'{config.method} with {n_params} parameters; mesh {dict(mesh.shape)} on '
          f'{jax.device_count()} devices, {pcount} processes; batch {config.batch_size}, '
          f'{steps_per_epoch} steps per epoch', flush=True)

  progress = Progress(steps_per_epoch, config.num_epochs, config.batch_size, main)
  status = 'finished'
  stopped = bool(sharding.to_host(state.stop_state.stop))
  with _Preemption() as preemption:
    while epoch < config.num_epochs and not stopped:
      start = step - epoch * steps_per_epoch
      t_epoch = time.time()
      for batch in itertools.islice(train_batches, steps_per_epoch - start):
        state, loss = trainer.train_step(state, sharding.global_batch(batch, mesh))
        step += 1
        if on_step is not None:
          on_step(step)
        in_epoch = step - epoch * steps_per_epoch
        if in_epoch % config.log_every == 0 or in_epoch == steps_per_epoch or step == 1:
          loss = float(sharding.to_host(loss))
          progress.line(step, epoch, loss, start)
          if not math.isfinite(loss):
            _fail(workdir, writer, main, epoch, step, loss)
        if preemption.requested(step, config.log_every):
          ckpts.save(step, state, data=train_batches)
          writer.write({'event': 'preempted', 'epoch': epoch, 'step': step,
                        'time': time.time() - t_start})
          if main:
            print(f'SIGTERM: saved checkpoint at step {step}; rerun with the same workdir to '
                  'resume.', flush=True)
          status = 'preempted'
          break
      if status == 'preempted':
        break
      train_sums = _scalars(state.sums)
      if not math.isfinite(train_sums['loss']):
        _fail(workdir, writer, main, epoch, step, train_sums['loss'])
      train_time = time.time() - t_epoch
      metrics = _rates(train_sums, 'train', steps_per_epoch * config.batch_size)
      metrics.update(evaluate(trainer, state, eval_loader, mesh, eval_batches))
      monitored = metrics[config.monitor]
      lr = float(sharding.to_host(state.lr_state.lr))
      state = trainer.end_of_epoch(state, np.float32(monitored))
      epoch += 1
      stop_host = sharding.to_host(state.stop_state)
      improved, stopped = bool(stop_host.improved), bool(stop_host.stop)
      record = {'epoch': epoch, 'step': step, 'lr': lr, **metrics,
                'next_lr': float(sharding.to_host(state.lr_state.lr)),
                'best_epoch': int(stop_host.best_epoch) + 1, 'stop': stopped,
                'epoch_time': time.time() - t_epoch,
                'train_images_per_s': (steps_per_epoch - start) * config.batch_size / max(
                    train_time, 1e-9)}
      writer.write(record)
      ckpts.save(step, state, best=improved, data=train_batches)
      if main:
        print(f'epoch {epoch}/{config.num_epochs}: train loss {metrics["train_loss"]:.4f} '
              f'top1 {metrics["train_top1"]:.4f} | eval loss {metrics["eval_loss"]:.4f} '
              f'top1 {metrics["eval_top1"]:.4f} top5 {metrics["eval_top5"]:.4f} | lr {lr:g} | '
              f'{record["epoch_time"]:.1f}s' + (' | early stop' if stopped else ''), flush=True)

  summary = {'status': status, 'epochs': epoch, 'steps': step, 'wall_time_s': time.time() - t_start,
             'num_devices': jax.device_count(), 'num_processes': pcount}
  best = None
  if status == 'finished':
    summary['last'] = evaluate(trainer, state, eval_loader, mesh, eval_batches)
    best = ckpts.restore_best(trainer.abstract_state) if config.restore_best else None
    if best is not None:
      summary['best_epoch'] = int(sharding.to_host(best.epoch))
      summary['best'] = evaluate(trainer, best, eval_loader, mesh, eval_batches)
  ckpts.close()
  if main:
    _report(workdir, summary, config)
  summary['state'] = state  # the last state (not in results.json)
  summary['best_state'] = best  # restored best checkpoint, or None
  return summary


def _report(workdir, summary, config) -> None:
  """results.json/csv/md through `report.write`, as every study writes them: the summary, one
  row per evaluated state (last, best) and their table. A preempted run's `status` says it
  is not finished (so the workdir is resumed, not refused as a finished run's)."""
  rows = [{'state': name, 'epoch': summary['best_epoch'] if name == 'best' else summary['epochs'],
           **summary[name]} for name in ('last', 'best') if name in summary]
  keys = sorted({k for r in rows for k in r} - {'state', 'epoch'})
  table = report.markdown_table(
      ['state', 'epoch', *keys],
      [[r['state'], r['epoch']] + [f'{r.get(k, float("nan")):.4f}' for k in keys] for r in rows])
  if not rows:
    table = f'status {summary["status"]} after {summary["steps"]} steps: no final evaluation.'
  report.write(workdir, 'train', summary=summary, rows=rows, table=table, claims={},
               config=config)  # no `started`: the summary's wall_time_s is the trainer's own


def _fail(workdir, writer, main, epoch, step, loss):
  msg = (f'non-finite training loss {loss} at step {step} (epoch {epoch + 1}); stopped without '
         f'saving this state. The last good checkpoint (end of epoch {epoch}, if any) is in '
         f'{os.path.join(workdir, "checkpoints", "last")}; lower the learning rate or check the '
         f'data.')
  writer.write({'event': 'nonfinite_loss', 'epoch': epoch, 'step': step, 'loss': str(loss),
                'message': msg})
  if main:
    with open(os.path.join(workdir, 'failure.json'), 'w') as f:
      json.dump({'reason': 'nonfinite_loss', 'epoch': epoch, 'step': step, 'message': msg}, f)
  raise FloatingPointError(msg)


run = train_and_evaluate  # the study entry point experiments.main calls
