"""Orbax checkpoints of the whole train state: the last one (every epoch, on SIGTERM) and the best.

`workdir/checkpoints/last/<step>` holds the most recent state (mid-epoch when
it was written on SIGTERM) as the item `state`, and the training data
iterator's grain state as the item `data` (`grain.PyGrainCheckpointSave`: one
file per process); `workdir/checkpoints/best/<step>` the state of the epoch
with the best monitored metric. Each keeps one checkpoint. Restoring uses the
abstract state (shapes, dtypes and shardings) so arrays come back sharded as
the running program expects, on one host or many. Checkpoints written before
the data item existed (one unnamed item) are still restored (their data
position then follows from the step).
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpoints:
  """The `last` and `best` checkpoint managers of a workdir."""

  def __init__(self, workdir: str):
    root = os.path.abspath(os.path.join(workdir, 'checkpoints'))
    self._opts = ocp.CheckpointManagerOptions(max_to_keep=1, create=True,
                                              enable_async_checkpointing=False)
    self.last = ocp.CheckpointManager(os.path.join(root, 'last'), options=self._opts)
    self.best = ocp.CheckpointManager(os.path.join(root, 'best'), options=self._opts)
    self.data_restored = False  # whether the last restore set the data iterator's state

  def save(self, step: int, state, best: bool = False, data=None) -> None:
    """Saves `state` (and the grain iterator `data`) as the last checkpoint; with `best`,
    `state` also as the best."""
    items = {'state': ocp.args.StandardSave(state)}
    if data is not None:
      import grain.python as grain  # pylint: disable=g-import-not-at-top
      items['data'] = grain.PyGrainCheckpointSave(data)
    self.last.save(int(step), args=ocp.args.Composite(**items), force=True)
    self.last.wait_until_finished()
    if best:
      self.best.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state)),
                     force=True)
      self.best.wait_until_finished()

  def _restore(self, manager, abstract_state, data=None):
    self.data_restored = False
    step = manager.latest_step()
    if step is None:
      return None
    folder = os.path.join(str(manager.directory), str(step))
    if os.path.isdir(os.path.join(folder, 'default')):  # the layout before the data item
      old = ocp.CheckpointManager(manager.directory, options=self._opts)
      return old.restore(step, args=ocp.args.StandardRestore(abstract_state))
    items = {'state': ocp.args.StandardRestore(abstract_state)}
    if data is not None and os.path.isdir(os.path.join(folder, 'data')):
      import grain.python as grain  # pylint: disable=g-import-not-at-top
      items['data'] = grain.PyGrainCheckpointRestore(data)
    restored = manager.restore(step, args=ocp.args.Composite(**items))
    self.data_restored = 'data' in items
    return restored['state']

  def restore_last(self, abstract_state, data=None):
    """The last state, or None; `abstract_state` from `jax.eval_shape` + shardings. A grain
    iterator `data` (of the same dataset) is set to its saved position when the checkpoint
    holds one (`data_restored`)."""
    return self._restore(self.last, abstract_state, data)

  def restore_best(self, abstract_state):
    return self._restore(self.best, abstract_state)

  def close(self):
    self.last.close()
    self.best.close()


def abstract(state_shapes, shardings):
  """ShapeDtypeStructs carrying shardings, the restore target."""
  return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state_shapes, shardings)
