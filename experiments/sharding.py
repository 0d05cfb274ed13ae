"""Mesh, shardings, global batches and multi-host start-up (jit + NamedSharding, no pmap).

The mesh has a `data` axis over which the batch is split and, optionally, a
second `model` axis; parameters and optimizer state are replicated by default.
Under `jax.jit` with a batch sharded over `data`, the batch means inside
BatchNorm / MBN / IMN are means over the GLOBAL batch (XLA inserts the
all-reduce), so the statistics do not depend on the number of devices.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.experimental import multihost_utils
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

DATA, MODEL = 'data', 'model'


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None,
                           auto: bool = False) -> None:
  """Starts `jax.distributed` when asked (several hosts); a no-op for one process.

  With `coordinator_address`, `num_processes` and `process_id` (e.g. several
  CPU/GPU processes), or `auto=True` (TPU pods and SLURM/GPU clusters that JAX
  detects itself). On CPU the gloo collectives are switched on first.
  """
  explicit = coordinator_address is not None or num_processes is not None or process_id is not None
  if not explicit and not auto:
    return
  if explicit and (coordinator_address is None or num_processes is None or process_id is None):
    raise ValueError(
        'multi-host needs all of coordinator_address, num_processes and process_id, got '
        f'{coordinator_address!r}, {num_processes!r}, {process_id!r}.')
  if explicit and not 0 <= process_id < num_processes:
    raise ValueError(f'process_id must be in [0, {num_processes}), got {process_id}.')
  try:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  except Exception:  # pylint: disable=broad-except  # older/newer jax without the option
    pass
  if explicit:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
  else:
    jax.distributed.initialize()


def make_mesh(shape: Sequence[int] = (-1,), devices=None) -> Mesh:
  """A mesh with axes `('data',)` or `('data', 'model')`; one -1 entry takes the rest."""
  devices = list(jax.devices() if devices is None else devices)
  shape = list(shape)
  if -1 not in shape and int(np.prod(shape)) < len(devices) and jax.process_count() == 1:
    devices = devices[:int(np.prod(shape))]  # e.g. (1,): one device, for comparisons
  if not 1 <= len(shape) <= 2:
    raise ValueError(f'mesh_shape must have 1 or 2 entries (data[, model]), got {shape}.')
  if shape.count(-1) > 1:
    raise ValueError(f'at most one mesh_shape entry may be -1, got {shape}.')
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(f'mesh_shape {shape} does not divide the {len(devices)} devices.')
    shape[shape.index(-1)] = len(devices) // known
  if int(np.prod(shape)) != len(devices):
    raise ValueError(f'mesh_shape {shape} needs {int(np.prod(shape))} devices, have {len(devices)}.')
  names = (DATA, MODEL)[:len(shape)]
  return Mesh(np.asarray(devices).reshape(shape), names)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over `data`, the rest replicated."""
  return NamedSharding(mesh, P(DATA))


def check_batch_size(global_batch: int, mesh: Mesh, what: str = 'batch_size') -> None:
  """Clear error when the global batch cannot be split evenly."""
  n_data = mesh.shape[DATA]
  if global_batch % n_data or global_batch % jax.process_count():
    raise ValueError(
        f'{what}={global_batch} is not divisible by the {n_data} devices of the mesh\'s '
        f'data axis ({jax.device_count()} devices, {jax.process_count()} processes); choose a '
        f'multiple of {np.lcm(n_data, jax.process_count())}.')


def global_batch(batch, mesh: Mesh):
  """Per-process numpy batch (leading axis = this process's part) -> global jax arrays.

  Uses `jax.make_array_from_process_local_data`, which is right on one host and
  on many (where `jnp.array(batch)` would be wrong).
  """
  sharding = batch_sharding(mesh)
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


def to_host(tree):
  """Fully replicated (or addressable) arrays -> numpy, on every process."""
  def get(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
  return jax.tree.map(get, tree)
