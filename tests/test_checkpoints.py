"""Resume: a run interrupted (SIGTERM mid-epoch, or stopped at an epoch end) and rerun in the
same workdir ends with exactly the state and metrics of an uninterrupted run.

All runs happen in one subprocess with JAX's persistent compilation cache, so each program
compiles once (every `train_and_evaluate` call builds fresh jitted functions).
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIME_KEYS = ('epoch_time', 'train_images_per_s', 'time')


def _config(data_dir, num_epochs):
  from experiments.configs import cifar10_cnn
  c = cifar10_cnn.get_config('smoke')
  # gmp_imn: IMN running means in batch_stats; plateau patience 1 so the LR really changes.
  c.update(dict(layers=(8, 'M', 16), method='gmp_imn', batch_size=8, eval_batch_size=8,
                learning_rate=0.05, log_every=1, num_workers=0, data_dir=data_dir,
                num_epochs=num_epochs, plateau_patience=1, plateau_min_delta=0.5))
  return c


def _worker(tmp):
  import jax
  from experiments.vision import sharding, train
  from tests import fixtures
  data = os.path.join(tmp, 'data')
  fixtures.write_fake_jpeg_archive(data, num_classes=3, train_per_class=8,
                                   test_per_class=4, size=8)

  def final(workdir, summary):
    leaves = sharding.to_host(jax.tree.leaves(summary['state']))
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      rows = [json.loads(l) for l in f]
    rows = [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in rows]
    return leaves, rows

  out = {}
  # A: uninterrupted, 3 epochs of 3 steps.
  a = final(os.path.join(tmp, 'a'), train.train_and_evaluate(_config(data, 3),
                                                             os.path.join(tmp, 'a')))
  # B: SIGTERM during step 5 (epoch 2), then the same command again.
  def kill_at(step):
    if step == 5:
      os.kill(os.getpid(), signal.SIGTERM)
  s1 = train.train_and_evaluate(_config(data, 3), os.path.join(tmp, 'b'), on_step=kill_at)
  out['b_first_status'] = s1['status']
  out['b_first_steps'] = s1['steps']
  saved = os.path.join(tmp, 'b', 'checkpoints', 'last', '5', 'data')
  out['b_data_files'] = sorted(f for f in os.listdir(saved) if f.endswith('.json'))
  out['b_data_state'] = [json.load(open(os.path.join(saved, f))) for f in out['b_data_files']]
  b = final(os.path.join(tmp, 'b'), train.train_and_evaluate(_config(data, 3),
                                                             os.path.join(tmp, 'b')))
  # C: killed hard after epoch 1 (as if mid-epoch 2, without SIGTERM) = a 1-epoch run, then 3.
  train.train_and_evaluate(_config(data, 1), os.path.join(tmp, 'c'))
  c = final(os.path.join(tmp, 'c'), train.train_and_evaluate(_config(data, 3),
                                                             os.path.join(tmp, 'c')))
  for name, run in (('b', b), ('c', c)):
    out[f'{name}_max_diff'] = max(
        float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) if x.size else 0.0
        for x, y in zip(a[0], run[0]))
    out[f'{name}_same_leaves'] = len(a[0]) == len(run[0])
    out[f'{name}_rows_equal'] = [r for r in run[1] if 'event' not in r] == a[1]
  out['a_rows'] = a[1]
  print('RESULT ' + json.dumps(out))


def test_resume_equals_uninterrupted(tmp_path):
  env = dict(os.environ)
  env.update(PYTHONPATH=ROOT + os.pathsep + env.get('PYTHONPATH', ''), JAX_PLATFORMS='cpu',
             GEOPARAM_CACHE_DIR=str(tmp_path / 'cache'),
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / 'jax_cache'),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
  proc = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=400)
  line = [l for l in proc.stdout.splitlines() if l.startswith('RESULT ')]
  assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = json.loads(line[-1][len('RESULT '):])
  assert out['b_first_status'] == 'preempted' and out['b_first_steps'] == 5, out
  # The resume lines count epochs as the progress lines do (from 1): B resumes inside epoch 2
  # (2 of its 3 steps done), C after epoch 1; the next progress line names the same epoch.
  lines = proc.stdout.splitlines()
  resumed = [l for l in lines if l.startswith('resumed from')]
  assert resumed == ['resumed from step 5: in epoch 2/3, at step 2/3',
                     'resumed from step 3: after epoch 1/3, continuing with epoch 2/3 at step 0/3'
                     ], resumed
  for text, progress in zip(resumed, ('epoch 2/3 step 3/3 ', 'epoch 2/3 step 1/3 ')):
    after = lines[lines.index(text) + 1:]
    assert next(l for l in after if l.startswith('epoch ')).startswith(progress), after[:3]
  # The data iterator's grain state is in the checkpoint: record 5 is next.
  assert len(out['b_data_files']) == 1 and 'process_0' in out['b_data_files'][0], out
  assert out['b_data_state'][0]['next_index'] == 5, out
  rows = out['a_rows']
  assert [r['epoch'] for r in rows] == [1, 2, 3]
  assert len({r['next_lr'] for r in rows}) > 1, rows  # the plateau rule acted
  for name in ('b', 'c'):
    assert out[f'{name}_same_leaves'], out
    assert out[f'{name}_max_diff'] == 0.0, out  # bitwise: same data order, same state
    assert out[f'{name}_rows_equal'], out


def test_old_checkpoint_layout_restores_and_the_data_iterator_resumes(tmp_path):
  """A checkpoint of one unnamed item (before the data item) still restores; a new one puts a
  grain iterator back at its record."""
  import grain.python as grain  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  from experiments.vision import checkpoints  # pylint: disable=g-import-not-at-top

  state = {'w': jnp.arange(3.0)}
  abstract = {'w': jax_shape(state['w'])}
  old = ocp.CheckpointManager(str(tmp_path / 'checkpoints' / 'last'),
                              options=ocp.CheckpointManagerOptions(create=True))
  old.save(4, args=ocp.args.StandardSave(state))
  old.wait_until_finished()
  ckpts = checkpoints.Checkpoints(str(tmp_path))
  records = lambda: iter(grain.MapDataset.range(0, 50).map(lambda r: r * 10).to_iter_dataset())
  back = ckpts.restore_last(abstract, data=records())
  np.testing.assert_array_equal(back['w'], state['w'])
  assert not ckpts.data_restored
  it = records()
  assert [next(it) for _ in range(7)] == [0, 10, 20, 30, 40, 50, 60]
  ckpts.save(7, {'w': state['w'] + 1}, data=it)
  fresh = records()
  back = ckpts.restore_last(abstract, data=fresh)
  assert ckpts.data_restored and next(fresh) == 70
  np.testing.assert_array_equal(back['w'], state['w'] + 1)
  assert checkpoints.Checkpoints(str(tmp_path)).restore_best(abstract) is None


def jax_shape(x):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


if __name__ == '__main__':
  sys.path.insert(0, ROOT)
  _worker(sys.argv[1])
