"""Sharded training equals one-device training; batch divisibility; 2-process jax.distributed.

The device-count tests run this file as a subprocess (`python tests/test_sharding.py ...`)
because `XLA_FLAGS=--xla_force_host_platform_device_count=8` must be set before JAX starts.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ('bn', 'wn_mbn', 'gmp_imn')  # BN, MBN and IMN batch statistics


def _env(devices):
  env = dict(os.environ)
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={devices}'
  env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
  env.pop('JAX_PLATFORMS', None)
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def _tiny_config(data_dir=None, method='bn'):
  from experiments.configs import cifar10_cnn
  c = cifar10_cnn.get_config('smoke')
  c.update(dict(layers=(8, 'M', 16), method=method, batch_size=8, eval_batch_size=8,
                learning_rate=0.05, log_every=100, num_workers=1, data_dir=data_dir))
  return c


# ---------------------------------------------------------------------------
# Workers (run in subprocesses).


def _equality_worker():
  import jax
  from experiments import input_pipeline, sharding, train
  assert jax.device_count() == 8, jax.devices()
  rng = np.random.default_rng(0)
  batches = [{'image': rng.integers(0, 256, (16, 8, 8, 3), dtype=np.uint8),
              'label': rng.integers(0, 10, 16).astype(np.int32),
              'mask': np.ones(16, np.float32)} for _ in range(3)]
  out = {}
  for method in METHODS:
    config = _tiny_config(method=method)
    results, start = {}, None
    for shape in ((1,), (8,), (4, 2)) if method == 'bn' else ((1,), (8,)):
      mesh = sharding.make_mesh(shape)
      trainer = train.Trainer(config, mesh, 10, input_pipeline.MEAN_STD['cifar'], (8, 8, 3))
      if start is None:  # one init (its compile is the slow part), placed on every mesh
        start = sharding.to_host(trainer.new_state())
      state = jax.device_put(start, trainer.state_sharding)
      for b in batches:
        state, _ = trainer.train_step(state, sharding.global_batch(b, mesh))
      assert len(state.params['out']['kernel'].sharding.device_set) == mesh.size
      results[shape] = sharding.to_host({'params': state.params, 'stats': state.batch_stats})
    ref = jax.tree.leaves(results[(1,)])
    out[method] = {
      str(shape): max(float(np.max(np.abs(a - b))) for a, b in zip(ref, jax.tree.leaves(r)))
      for shape, r in results.items() if shape != (1,)}
    out[method]['num_stats'] = len(jax.tree.leaves(results[(1,)]['stats']))
  try:
    sharding.check_batch_size(12, sharding.make_mesh((8,)))
    out['divisibility_error'] = None
  except ValueError as e:
    out['divisibility_error'] = str(e)
  print('RESULT ' + json.dumps(out))


def _train_worker(workdir, data_dir, cache_dir, port=None, process_id=None, num_processes=None):
  os.environ['GEOPARAM_CACHE_DIR'] = cache_dir
  from experiments import sharding, train
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
  from experiments import sharding
  with pytest.raises(ValueError, match='mesh_shape'):
    sharding.make_mesh((-1, -1))
  with pytest.raises(ValueError, match='multi-host needs all'):
    sharding.initialize_distributed('127.0.0.1:1', None, 0)


def test_sharded_steps_equal_one_device():
  proc = subprocess.run([sys.executable, __file__, 'equality'], env=_env(8), cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  line = [l for l in proc.stdout.splitlines() if l.startswith('RESULT ')]
  assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = json.loads(line[-1][len('RESULT '):])
  print(out)
  for method in METHODS:
    assert out[method]['num_stats'] >= 1, method  # the model really has batch statistics
    for shape in ('(8,)', '(4, 2)') if method == 'bn' else ('(8,)',):
      assert out[method][shape] < 1e-5, (method, shape, out[method])
  assert 'batch_size=12 is not divisible by the 8 devices' in out['divisibility_error']


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def test_two_processes_equal_one(tmp_path):
  from experiments import input_pipeline
  data = str(tmp_path / 'data')
  input_pipeline.write_fake_jpeg_archive(data, num_classes=3, train_per_class=8,
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
    _equality_worker()
  elif sys.argv[1] == 'train':
    _train_worker(*sys.argv[2:])
  else:
    raise SystemExit(f'unknown worker {sys.argv[1]!r}')
