"""Batching: per-process batches of a random-access source, in a deterministic order.

Order and sharding. Epoch `e` of the training set visits the examples in the
order `permutation(seed, e)`; global batch `b` is the slice `[b*B, (b+1)*B)` of
it and process `i` of `p` reads only its contiguous `B/p` part of every global
batch (the random-access equivalent of `tfds.even_splits`: each process reads
1/p of the data, and the assembled global batch is the same for any number of
processes, so a 2-host run equals a 1-host run). Augmentation randomness is
drawn per global batch from `(seed, epoch, b)`, so it is also independent of
the process count and of where a resumed run starts. The last partial training
batch is dropped; evaluation pads the last batch and gives padded examples
`mask = 0`.

Batches are numpy dicts `{'image': uint8 (b, h, w, 3), 'label': int32 (b,),
'mask': float32 (b,)}` and whatever per-example arrays the augmentation adds
(`experiments.vision.augmentation`); the train step normalizes images on the device. An image
that cannot be decoded is skipped (warned once, masked out, counted in the epoch's metrics),
never a crash.

Batches are built by grain (`Loader`): `grain.MapDataset` maps a record index to a batch,
built on `num_threads` threads and `prefetch` batches ahead while the devices run (PIL and
numpy release the GIL), and with `num_workers > 0` in grain worker processes (`mp_prefetch`,
the order kept).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from absl import flags
from absl import logging
import numpy as np

from experiments.vision import augmentation
from experiments.vision import sources


class Loader:
  """Per-process batches of a random-access source, in a deterministic order, built by grain.

  Record `r` of the loader is this process's part of global batch `r % steps_per_epoch` of
  epoch `r // steps_per_epoch`, a pure function of `(seed, r)` (see the module docstring), so
  the batches are the same for any number of processes and workers, and a run resumes at any
  step by starting at its record. `grain.MapDataset` maps records to batches;
  `to_iter_dataset` builds them on `num_threads` threads and `prefetch` ahead, and with
  `num_workers > 0` grain's `mp_prefetch` runs that in worker processes (each its share of the
  records, the order kept).

  Args:
    source: has `len()` and `get(indices) -> (images, labels)` (picklable for worker processes).
    global_batch: examples per step over all processes.
    train: shuffle per epoch, drop the last partial batch, augment; else
      sequential order and a padded, masked last batch.
    augment: `(images, uniforms (b, NUM_UNIFORMS), errors=list) -> uint8 (b, h, w, 3)`, or a
      dict of it (`'image'`) and further per-example arrays that the batch carries too
      (`augmentation.make_augment`). An encoded image it cannot decode (reported in `errors`)
      is skipped: warned once per process (naming its file), `mask = 0` in the batch, its slot
      filled with another image of the batch; `skipped` holds the indices met in this process.
    seed: data-order and augmentation seed.
    process_index, process_count: this process's part of each global batch.
    num_workers: grain worker processes building batches (0: none, threads of this process).
    num_threads: threads building batches in each process; prefetch: batches built ahead.
  """

  def __init__(self, source, global_batch: int, train: bool, augment, seed: int = 0,
               process_index: int = 0, process_count: int = 1, num_workers: int = 0,
               prefetch: int = 2, num_threads: int = 2):
    if global_batch % process_count:
      raise ValueError(
          f'global batch size {global_batch} is not divisible by the number of processes '
          f'{process_count}.')
    n = len(source)
    if train and n < global_batch:
      raise ValueError(f'the training set has {n} examples, fewer than one batch ({global_batch}).')
    if num_workers < 0 or num_threads < 1 or prefetch < 1:
      raise ValueError(f'need num_workers >= 0, num_threads >= 1 and prefetch >= 1; got '
                       f'{num_workers}, {num_threads}, {prefetch}.')
    self.source, self.global_batch, self.train, self.augment = source, global_batch, train, augment
    self.seed, self.process_index, self.process_count = seed, process_index, process_count
    self.local_batch = global_batch // process_count
    self.num_workers, self.num_threads, self.prefetch = num_workers, num_threads, prefetch
    self.steps_per_epoch = n // global_batch if train else -(-n // global_batch)
    self.skipped: set[int] = set()  # examples that could not be decoded (warned once each)
    self._lock = threading.Lock()
    self._orders: dict[int, np.ndarray] = {}

  def __getstate__(self):  # worker processes get a copy without the lock and the cached orders
    state = dict(self.__dict__)
    del state['_lock']
    state['_orders'] = {}
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def order(self, epoch: int) -> np.ndarray:
    n = len(self.source)
    if not self.train:
      return np.arange(n)
    return np.random.default_rng([self.seed, epoch]).permutation(n)

  def _batch(self, order: np.ndarray, epoch: int, b: int) -> dict[str, np.ndarray]:
    n = len(self.source)
    pos = b * self.global_batch + self.process_index * self.local_batch + np.arange(
        self.local_batch)
    mask = (pos < n).astype(np.float32)
    idx = order[np.minimum(pos, n - 1)]
    # One draw per global batch, sliced: independent of the process count.
    u = np.random.default_rng([self.seed, epoch, b, 1]).random(
        (self.global_batch, augmentation.NUM_UNIFORMS), dtype=np.float32)
    u = u[self.process_index * self.local_batch:(self.process_index + 1) * self.local_batch]
    # Sorted reads are friendlier to record files; the result is put back in batch order.
    sort = np.argsort(idx, kind='stable')
    images, labels = self.source.get(idx[sort])
    inv = np.empty_like(sort)
    inv[sort] = np.arange(len(sort))
    images = [images[i] for i in inv] if isinstance(images, list) else np.asarray(images)[inv]
    labels = np.asarray(labels, np.int32)[inv]
    errors = []
    images = self.augment(images, u, errors=errors)
    extra = {}
    if isinstance(images, dict):  # the augmentation adds per-example inputs of the train step
      extra = {k: v for k, v in images.items() if k != 'image'}
      images = images['image']
    images = np.ascontiguousarray(images, np.uint8)
    bad = [k for k, e in enumerate(errors) if e]
    if bad:  # undecodable files: masked out, their slots hold a good image of the batch
      good = [k for k in range(len(images)) if not errors[k]]
      for k in bad:
        self._skip(int(idx[k]), errors[k])
        mask[k] = 0.0
        if good:  # so that batch statistics (BN, IMN) only see real images
          images[k] = images[good[0]]
    return {'image': images, 'label': labels, 'mask': mask, **extra}

  def _skip(self, index: int, error: str) -> None:
    """Warns once per example that cannot be decoded (naming its file where the source knows it)."""
    with self._lock:
      if index in self.skipped:
        return
      self.skipped.add(index)
    logging.warning('skipping an image that cannot be decoded: %s (%s); it is masked out of '
                    'every batch it is drawn in', sources.describe(self.source, index), error)

  def batch_at(self, r: int) -> dict[str, np.ndarray]:
    """Record `r`: this process's part of batch `r % steps_per_epoch` of epoch
    `r // steps_per_epoch`."""
    epoch, b = divmod(int(r), self.steps_per_epoch)
    with self._lock:
      order = self._orders.get(epoch)
      if order is None:
        order = self._orders[epoch] = self.order(epoch)
        for old in [e for e in self._orders if e < epoch - 1]:
          del self._orders[old]
    return self._batch(order, epoch, b)

  def iterate(self, epoch: int = 0, start_step: int = 0,
              stop_epoch: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """This process's batches from step `start_step` of `epoch` through the end of epoch
    `stop_epoch - 1` (None: on and on), one grain iterator across epochs (its workers keep
    building the next epoch's batches while the caller evaluates)."""
    import grain.python as grain  # pylint: disable=g-import-not-at-top

    steps = self.steps_per_epoch
    start = epoch * steps + start_step
    stop = start + (1 << 62) if stop_epoch is None else stop_epoch * steps
    ds = grain.MapDataset.range(start, stop).map(self.batch_at).to_iter_dataset(
        grain.ReadOptions(num_threads=self.num_threads, prefetch_buffer_size=self.prefetch))
    if self.num_workers > 0:
      if not flags.FLAGS.is_parsed():  # grain's workers read its absl flags: their defaults
        flags.FLAGS.mark_as_parsed()
      ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.num_workers))
    return iter(ds)

  def epoch(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Yields this process's batches `start_step, ..., steps_per_epoch - 1` of `epoch`."""
    return self.iterate(epoch, start_step, epoch + 1)
