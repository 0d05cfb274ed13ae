"""Sharded training equals one-device training; batch divisibility; 2-process jax.distributed.

Mesh `(8,)` (data parallel) for BN, MBN and IMN, and `(2, 4)` (data x model: FSDP-style
feature-axis sharding of parameters and optimizer state over `model`) for GmP+IMN, whose angles
must keep their fan-in axis whole; `(4, 2)` for a model with partitioning metadata.

The device-count tests run this file as a subprocess (`python tests/test_sharding.py ...`)
because `XLA_FLAGS=--xla_force_host_platform_device_count=8` must be set before JAX starts.
"""

import functools
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ('bn', 'wn_mbn', 'gmp_imn')  # BN, MBN and IMN batch statistics
MESHES = {'bn': ((1,), (8,)), 'wn_mbn': ((1,), (8,)), 'gmp_imn': ((1,), (8,), (2, 4))}
# A parameter whose last axis (16 features) the (2, 4) mesh splits 4 ways: GmP's angles
# `theta (fan_in - 1, features)`, whose fan-in axis must stay whole.
SPLIT = {'gmp_imn': ('conv_1', 'theta')}


def _env(devices):
  env = dict(os.environ)
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                      f' --xla_force_host_platform_device_count={devices}')
  env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
  env.pop('JAX_PLATFORMS', None)
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def _tiny_config(data_dir=None, method='bn'):
  from experiments.configs import cifar10_cnn
  c = cifar10_cnn.get_config('smoke')
  c.update(dict(layers=(8, 'M', 16), method=method, batch_size=8, eval_batch_size=8,
                learning_rate=0.05, log_every=100, num_workers=0, data_dir=data_dir))
  return c


def _partitioned_net():
  """A model with partitioning metadata: hidden kernel (None, 'model'), output ('model', None)."""
  import flax.linen as nn

  class PartitionedNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
      del train
      init = nn.initializers.lecun_normal()
      x = x.reshape(x.shape[0], -1)
      x = nn.relu(nn.Dense(16, kernel_init=nn.with_partitioning(init, (None, 'model')),
                           name='hidden')(x))
      return nn.Dense(10, kernel_init=nn.with_partitioning(init, ('model', None)),
                      name='out')(x)

  return PartitionedNet()


# ---------------------------------------------------------------------------
# Workers (run in subprocesses).


def _max_diffs(ref, other):
  """(max abs, max relative to each leaf's largest entry) differences over leaves."""
  import jax
  pairs = list(zip(jax.tree.leaves(ref), jax.tree.leaves(other)))
  return (max(float(np.max(np.abs(a - b))) for a, b in pairs),
          max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-12)) for a, b in pairs))


def _spec(x):
  return [list(e) if isinstance(e, tuple) else e for e in x.sharding.spec]


def _run_steps(config, shapes, batches, tmp=None):
  """3 steps from one initial state on each mesh -> host results and sharding facts."""
  import jax
  from experiments.vision import checkpoints, sharding, sources, train
  results, facts, start = {}, {}, None
  for shape in shapes:
    mesh = sharding.make_mesh(shape)
    trainer = train.Trainer(config, mesh, 10, sources.MEAN_STD['cifar'], (8, 8, 3))
    if start is None:  # one init (its compile is the slow part), placed on every mesh
      start = sharding.to_host(trainer.new_state())
    state = jax.device_put(start, trainer.state_sharding)
    for b in batches:
      state, _ = trainer.train_step(state, sharding.global_batch(b, mesh))
    assert len(state.params['out']['kernel'].sharding.device_set) == mesh.size
    results[shape] = sharding.to_host({'params': state.params, 'stats': state.batch_stats})
    if shape == (2, 4) and tmp is not None:  # sharded save -> restore onto the same shardings
      ckpts = checkpoints.Checkpoints(tmp)
      ckpts.save(3, state)
      back = ckpts.restore_last(trainer.abstract_state)
      ckpts.close()
      same = jax.tree.map(lambda a, b: a.sharding == b.sharding and bool(
          np.array_equal(np.asarray(a), np.asarray(b))), state, back)
      facts['restored_equal'] = all(jax.tree.leaves(same))
    facts[str(shape)] = state
  return results, facts


def _equality_worker(tmp):
  import jax
  from experiments.vision import sharding, train
  assert jax.device_count() == 8, jax.devices()
  rng = np.random.default_rng(0)
  batches = [{'image': rng.integers(0, 256, (16, 8, 8, 3), dtype=np.uint8),
              'label': rng.integers(0, 10, 16).astype(np.int32),
              'mask': np.ones(16, np.float32)} for _ in range(3)]
  out = {}
  for method in METHODS:
    results, facts = _run_steps(_tiny_config(method=method), MESHES[method], batches,
                                os.path.join(tmp, method))
    out[method] = {str(shape): _max_diffs(results[(1,)], r)
                   for shape, r in results.items() if shape != (1,)}
    out[method]['num_stats'] = len(jax.tree.leaves(results[(1,)]['stats']))
    if method in SPLIT:
      layer, name = SPLIT[method]
      state = facts['(2, 4)']
      x, m = state.params[layer][name], state.opt_state.inner_state[0].trace[layer][name]
      out[method]['split'] = {'shape': x.shape, 'spec': _spec(x),
                              'shard': x.addressable_shards[0].data.shape,
                              'momentum_spec': _spec(m), 'count_spec': _spec(
                                  state.opt_state.count),
                              'out_bias_spec': _spec(state.params['out']['bias'])}
      out[method]['restored_equal'] = facts['restored_equal']
  # Partitioning metadata (nn.with_partitioning) through the Trainer: specs, jit, steps.
  real_create_model = train.create_model
  train.create_model = lambda config, num_classes: _partitioned_net()
  try:
    results, facts = _run_steps(_tiny_config(method='sp'), ((1,), (4, 2)), batches)
    params = facts['(4, 2)'].params
    out['metadata'] = {
        'diffs': _max_diffs(results[(1,)], results[(4, 2)]),
        'specs': {f'{l}/{n}': _spec(params[l][n]) for l in params for n in params[l]},
        'hidden_shard': params['hidden']['kernel'].addressable_shards[0].data.shape,
        'out_shard': params['out']['kernel'].addressable_shards[0].data.shape}
    boxed = jax.eval_shape(functools.partial(train.init_variables, _partitioned_net(),
                                             (8, 8, 3)), jax.random.key(0))['params']
    out['metadata']['specs_1d'] = [
        list(s.spec) for s in jax.tree.leaves(sharding.param_shardings(
            sharding.make_mesh((8,)), boxed))]
  finally:
    train.create_model = real_create_model
  out['imn_shard_map'] = _imn_shard_map_worker(rng)
  try:
    sharding.check_batch_size(12, sharding.make_mesh((8,)))
    out['divisibility_error'] = None
  except ValueError as e:
    out['divisibility_error'] = str(e)
  print('RESULT ' + json.dumps(out))


def _imn_shard_map_worker(rng):
  """IMN with axis_name inside shard_map: each device's mean is the global-batch mean."""
  import flax.linen as nn
  import jax
  from jax.sharding import PartitionSpec as P
  import geoparam
  from experiments.vision import sharding
  mesh = sharding.make_mesh((8,))
  x = (rng.normal(size=(16, 5)) + np.arange(16)[:, None]).astype(np.float32)  # shards differ
  diffs = {}
  for axis_name in ('data', None):
    layer = geoparam.GmP(nn.Dense(3), input_mean_norm=True, axis_name=axis_name)
    v = layer.init(jax.random.key(0), x[:2], use_running_average=False)

    def running_mean(xs, layer=layer, v=v):
      _, upd = layer.apply(v, xs, use_running_average=False, mutable=['batch_stats'])
      return upd['batch_stats']['input_mean_norm']['mean'][None]

    means = jax.shard_map(running_mean, mesh=mesh, in_specs=P('data'), out_specs=P('data'))(x)
    diffs[str(axis_name)] = float(np.abs(np.asarray(means) - 0.01 * x.mean(0)).max())
  return diffs


def _train_worker(workdir, data_dir, cache_dir, port=None, process_id=None, num_processes=None):
  os.environ['GEOPARAM_CACHE_DIR'] = cache_dir
  from experiments.vision import sharding, train
  if port is not None:
    sharding.initialize_distributed(f'127.0.0.1:{port}', int(num_processes), int(process_id))
  import jax
  config = _tiny_config(data_dir=data_dir, method='bn')
  config.num_epochs = 2
  summary = train.train_and_evaluate(config, workdir)
  leaves = sharding.to_host(jax.tree.leaves(
      {'params': summary['state'].params, 'stats': summary['state'].batch_stats}))
  if jax.process_index() == 0:
    np.savez(os.path.join(workdir, 'final.npz'), *leaves)
  print(f'RESULT processes={jax.process_count()} devices={jax.device_count()}')


# ---------------------------------------------------------------------------
# Tests.


def test_mesh_and_distributed_argument_errors():
  from experiments.vision import sharding
  with pytest.raises(ValueError, match='mesh_shape'):
    sharding.make_mesh((-1, -1))
  with pytest.raises(ValueError, match='multi-host needs all'):
    sharding.initialize_distributed('127.0.0.1:1', None, 0)


def test_sharded_steps_equal_one_device(tmp_path):
  """Data-parallel and FSDP (data x model) steps equal one device; params really split."""
  proc = subprocess.run([sys.executable, __file__, 'equality', str(tmp_path)], env=_env(8),
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  line = [l for l in proc.stdout.splitlines() if l.startswith('RESULT ')]
  assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = json.loads(line[-1][len('RESULT '):])
  print(out)
  for method in METHODS:
    assert out[method]['num_stats'] >= 1, method  # the model really has batch statistics
    for shape in MESHES[method][1:]:
      abs_diff, rel_diff = out[method][str(shape)]
      assert abs_diff < 1e-5 and rel_diff < 1e-5, (method, shape, out[method])
  for method in SPLIT:  # on (2, 4): 16 features -> 4 per device, fan-in axes whole
    split = out[method]['split']
    assert split['spec'] == [None] * (len(split['shape']) - 1) + ['model'], split
    assert split['shard'] == split['shape'][:-1] + [split['shape'][-1] // 4], split
    assert split['momentum_spec'] == split['spec'], split  # optimizer state mirrors params
    assert split['count_spec'] == [], split  # scalars replicated
    assert split['out_bias_spec'] == [], split  # 10 features: not divisible by 4, replicated
    assert out[method]['restored_equal'], method  # orbax restore keeps shardings and values
  assert out['imn_shard_map']['data'] < 1e-6, out['imn_shard_map']  # global batch mean
  assert out['imn_shard_map']['None'] > 1e-3, out['imn_shard_map']  # per-device without it
  meta = out['metadata']
  assert meta['diffs'][0] < 1e-5 and meta['diffs'][1] < 1e-5, meta
  assert meta['specs'] == {'hidden/kernel': [None, 'model'],  # metadata
                           'out/kernel': ['model'],  # metadata ('model', None), not the rule
                           'hidden/bias': ['model'], 'out/bias': ['model']}, meta  # the rule
  assert meta['hidden_shard'] == [192, 8] and meta['out_shard'] == [8, 10], meta
  assert all(spec == [] for spec in meta['specs_1d']), meta  # no model axis: replicated
  assert 'batch_size=12 is not divisible by the 8 devices' in out['divisibility_error']


def test_feature_axis_rule_metadata_and_optimizer_state():
  """The sharding rules on abstract meshes (no devices needed)."""
  import flax.linen as nn
  import jax
  import optax
  from jax.sharding import AbstractMesh
  from jax.sharding import PartitionSpec as P
  from experiments.vision import sharding
  mesh, flat = AbstractMesh((4, 2), ('data', 'model')), AbstractMesh((8,), ('data',))
  assert sharding.feature_spec((26, 8), mesh) == P(None, 'model')  # GmP theta: fan-in whole
  assert sharding.feature_spec((3, 3, 8, 16), mesh) == P(None, None, None, 'model')
  assert sharding.feature_spec((5,), mesh) == P() == sharding.feature_spec((), mesh)
  assert sharding.feature_spec((26, 8), flat) == P()

  def boxed(features, names):
    dense = nn.Dense(features, kernel_init=nn.with_partitioning(
        nn.initializers.lecun_normal(), names))
    return jax.eval_shape(dense.init, jax.random.key(0), np.zeros((1, 6), np.float32))['params']

  specs = jax.tree.map(lambda s: s.spec, sharding.param_shardings(mesh, boxed(4, ('model', None))))
  assert specs == {'kernel': P('model'), 'bias': P('model')}, specs
  with pytest.raises(ValueError, match='cannot be split 2 ways'):
    sharding.param_shardings(mesh, boxed(5, (None, 'model')))
  with pytest.raises(ValueError, match="name \\['mlp'\\]"):
    sharding.param_shardings(mesh, boxed(4, (None, 'mlp')))
  params = nn.unbox(boxed(4, ('model', None)))
  shardings = sharding.param_shardings(mesh, boxed(4, ('model', None)))
  opt = jax.eval_shape(optax.adam(0.1).init, params)
  opt_sh = sharding.mirror_shardings(mesh, opt, params, shardings)
  assert opt_sh[0].mu['kernel'].spec == opt_sh[0].nu['kernel'].spec == P('model')
  assert opt_sh[0].count.spec == P()


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def test_two_processes_equal_one(tmp_path):
  from tests import fixtures
  data = str(tmp_path / 'data')
  fixtures.write_fake_jpeg_archive(data, num_classes=3, train_per_class=8,
                                   test_per_class=4, size=8)
  cache = str(tmp_path / 'cache')
  single = subprocess.Popen(
      [sys.executable, __file__, 'train', str(tmp_path / 'one'), data, cache],
      env=_env(4), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  single_out = single.communicate(timeout=300)[0]
  assert single.returncode == 0, single_out[-4000:]
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, __file__, 'train', str(tmp_path / 'two'), data, cache, str(port), str(i),
       '2'], env=_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  outs = [p.communicate(timeout=300)[0] for p in procs]
  for p, o in zip(procs, outs):
    assert p.returncode == 0, o[-4000:]
  assert 'RESULT processes=2 devices=4' in outs[0], outs[0][-2000:]
  assert 'RESULT processes=1 devices=4' in single_out
  a = np.load(tmp_path / 'one' / 'final.npz')
  b = np.load(tmp_path / 'two' / 'final.npz')
  assert len(a.files) == len(b.files) > 0
  for k in a.files:
    np.testing.assert_allclose(a[k], b[k], atol=1e-5, rtol=1e-5)
  rows = [[json.loads(l) for l in (tmp_path / d / 'metrics.jsonl').read_text().splitlines()]
          for d in ('one', 'two')]
  assert len(rows[0]) == len(rows[1]) == 2
  for r1, r2 in zip(*rows):
    for k in ('train_loss', 'eval_loss', 'eval_top1', 'train_top1'):
      assert r1[k] == pytest.approx(r2[k], abs=1e-5), k


if __name__ == '__main__':
  sys.path.insert(0, ROOT)
  if sys.argv[1] == 'equality':
    _equality_worker(sys.argv[2])
  elif sys.argv[1] == 'train':
    _train_worker(*sys.argv[2:])
  else:
    raise SystemExit(f'unknown worker {sys.argv[1]!r}')
