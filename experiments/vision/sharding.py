"""Mesh, shardings, global batches and multi-host start-up (jit + NamedSharding, no pmap).

The mesh has a `data` axis over which the batch is split and, optionally, a
second `model` axis over which parameters are stored FSDP-style, split along
their FEATURE axes: each device of a `model` row keeps 1/n of every parameter
(n = the `model` axis size), and XLA all-gathers a parameter before it is used
(`gather_params` inside the step); the gradient, summed over the global batch,
is split again for the update (a reduce-scatter where XLA fuses it). The batch
is split over `data` only, so the devices of one `model` row compute the same
thing on the same examples; the `model` axis saves memory, not compute.

Which axis is split (`param_shardings`):

- partitioning metadata when the model supplies it: `nn.Partitioned` boxes from
  `nn.with_partitioning(init, names)`, read with `nn.get_partition_spec`;
  the name `'model'` is the mesh's `model` axis (dropped on a mesh without
  one), and a name that is no mesh axis is an error;
- otherwise the rule `feature_spec`: the LAST axis (the output features of a
  Dense/Conv kernel, of a bias or scale, of GmP's `theta (fan_in - 1, features)`)
  over `model` when its size is divisible by the `model` axis size, else
  replicated. Scalars are replicated. GmP's fan-in axis, a sequential product
  of sines, is therefore never split.

Optimizer-state subtrees that mirror the parameters (momentum, Adam moments)
get the parameters' shardings (`mirror_shardings`); every other leaf, e.g.
`batch_stats` (per-feature vectors), follows `feature_spec`, so counters and
schedules stay replicated. On a mesh without a `model` axis (or with one of
size 1) everything but the batch is replicated: plain data parallelism.

Under `jax.jit` with a batch sharded over `data`, the batch means inside
BatchNorm / MBN / IMN are means over the GLOBAL batch (XLA inserts the
all-reduce), so the statistics do not depend on the number of devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
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


def _model_size(mesh: Mesh) -> int:
  return int(mesh.shape[MODEL]) if MODEL in mesh.axis_names else 1


def feature_spec(shape: Sequence[int], mesh: Mesh) -> P:
  """The rule for a leaf without partitioning metadata: last axis over `model` when divisible.

  `P(None, ..., 'model')` when the mesh has a `model` axis, the leaf has at least one
  dimension and its last one is a multiple of the `model` axis size; else `P()`.
  """
  shape = tuple(shape)
  if MODEL not in mesh.axis_names or not shape or shape[-1] % _model_size(mesh):
    return P()
  return P(*([None] * (len(shape) - 1)), MODEL)


def _metadata_spec(path: str, box: nn.Partitioned, mesh: Mesh) -> P:
  """`nn.get_partition_spec` of one box, with its names checked against the mesh."""
  shape = tuple(box.value.shape)
  spec = tuple(nn.get_partition_spec(box))
  if len(spec) > len(shape):
    raise ValueError(f'partitioning names {box.names} of {path} have more entries than its '
                     f'shape {shape}.')
  out = []
  for dim, entry in zip(shape, spec):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    unknown = [n for n in names if n != MODEL and n not in mesh.axis_names]
    if unknown:
      raise ValueError(f'partitioning names {box.names} of {path} name {unknown}, which are no '
                       f'axes of the mesh {dict(mesh.shape)} (logical names must be mapped to '
                       f'mesh axes first).')
    names = tuple(n for n in names if n in mesh.axis_names)  # 'model' on a 1-axis mesh: dropped
    parts = int(np.prod([mesh.shape[n] for n in names]))
    if dim % parts:
      raise ValueError(f'{path} has shape {shape}; its axis of size {dim} cannot be split '
                       f'{parts} ways over {names} of the mesh {dict(mesh.shape)}.')
    out.append(None if not names else names[0] if len(names) == 1 else names)
  while out and out[-1] is None:  # P(None, None) -> P(): the same sharding, one spelling
    out.pop()
  return P(*out)


def param_shardings(mesh: Mesh, params: Any) -> Any:
  """NamedShardings of a (possibly boxed) parameter tree, e.g. `jax.eval_shape(model.init, ...)`.

  `nn.Partitioned` leaves use their metadata, all others `feature_spec`; the result
  has the structure of the UNBOXED tree (`nn.unbox(params)`).
  """
  def one(path, x):
    if isinstance(x, nn.LogicallyPartitioned):
      raise ValueError(f'{jax.tree_util.keystr(path)} has logical partitioning names {x.names}; '
                       'use nn.with_partitioning with mesh axis names.')
    if isinstance(x, nn.Partitioned):
      return NamedSharding(mesh, _metadata_spec(jax.tree_util.keystr(path), x, mesh))
    return NamedSharding(mesh, feature_spec(np.shape(x), mesh))
  return jax.tree_util.tree_map_with_path(
      one, params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def mirror_shardings(mesh: Mesh, tree: Any, params: Any, shardings: Any) -> Any:
  """Shardings of e.g. an optimizer state: subtrees shaped like `params` get `shardings`.

  A subtree mirrors the parameters when it has their tree structure and leaf shapes
  (optax's `mu`, `nu`, `trace`); every other leaf follows `feature_spec` (scalar
  counts and hyperparameters: replicated). `tree` and `params` may hold arrays or
  `jax.ShapeDtypeStruct`s.
  """
  p_leaves, p_def = jax.tree.flatten(params)
  p_shapes = [np.shape(x) for x in p_leaves]

  def mirrors(x):
    leaves, treedef = jax.tree.flatten(x)
    return treedef == p_def and [np.shape(l) for l in leaves] == p_shapes

  def one(x):
    if mirrors(x):
      return shardings
    return NamedSharding(mesh, feature_spec(np.shape(x), mesh))
  return jax.tree.map(one, tree, is_leaf=mirrors)


def gather_params(tree: Any, mesh: Mesh) -> Any:
  """`tree` constrained to be replicated: inside jit, the all-gather of FSDP before use."""
  return jax.lax.with_sharding_constraint(tree, replicated(mesh))


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
