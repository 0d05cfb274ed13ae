"""Orbax checkpoints of the whole train state: the last one (every epoch, on SIGTERM) and the best.

`workdir/checkpoints/last/<step>` holds the most recent state (mid-epoch when
it was written on SIGTERM), `workdir/checkpoints/best/<step>` the state of the
epoch with the best monitored metric. Each keeps one checkpoint. Restoring
uses the abstract state (shapes, dtypes and shardings) so arrays come back
sharded as the running program expects, on one host or many.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpoints:
  """The `last` and `best` checkpoint managers of a workdir."""

  def __init__(self, workdir: str):
    root = os.path.abspath(os.path.join(workdir, 'checkpoints'))
    opts = ocp.CheckpointManagerOptions(max_to_keep=1, create=True,
                                        enable_async_checkpointing=False)
    self.last = ocp.CheckpointManager(os.path.join(root, 'last'), options=opts)
    self.best = ocp.CheckpointManager(os.path.join(root, 'best'), options=opts)

  def save(self, step: int, state, best: bool = False) -> None:
    """Saves `state` as the last (and, with `best`, as the best) checkpoint."""
    self.last.save(int(step), args=ocp.args.StandardSave(state), force=True)
    self.last.wait_until_finished()
    if best:
      self.best.save(int(step), args=ocp.args.StandardSave(state), force=True)
      self.best.wait_until_finished()

  @staticmethod
  def _restore(manager, abstract_state):
    step = manager.latest_step()
    if step is None:
      return None
    return manager.restore(step, args=ocp.args.StandardRestore(abstract_state))

  def restore_last(self, abstract_state):
    """The last state, or None; `abstract_state` from `jax.eval_shape` + shardings."""
    return self._restore(self.last, abstract_state)

  def restore_best(self, abstract_state):
    return self._restore(self.best, abstract_state)

  def close(self):
    self.last.close()
    self.best.close()


def abstract(state_shapes, shardings):
  """ShapeDtypeStructs carrying shardings, the restore target."""
  return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state_shapes, shardings)
