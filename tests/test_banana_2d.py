"""The Banana study: data protocol, a tiny end-to-end run, and the CLI."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import banana_2d
from geoparam import analysis

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.environ.get('GEOPARAM_DATA_DIR') or os.path.join(ROOT, '..', 'shared', 'data')
needs_data = pytest.mark.skipif(not os.path.exists(os.path.join(DATA_DIR, 'banana.csv')),
                                reason=f'banana.csv not in {DATA_DIR} (set GEOPARAM_DATA_DIR)')


@needs_data
def test_data_follows_protocol():
  x, y = banana_2d.load_banana(DATA_DIR)
  assert x.shape == (5300, 2) and set(np.unique(y)) == {0, 1}
  data = banana_2d.make_data(x, y, 0)
  assert data['x_train'].shape == (800, 2) and data['x_test'].shape == (200, 2)
  np.testing.assert_allclose(data['x_train'].mean(0), 0, atol=1e-12)
  np.testing.assert_allclose(data['x_train'].std(0), 1, atol=1e-12)
  # Test points are standardized with the TRAINING statistics, not their own.
  assert np.max(np.abs(data['x_test'].mean(0))) > 1e-6
  again = banana_2d.make_data(x, y, 0)
  np.testing.assert_array_equal(again['x_test'], data['x_test'])
  assert not np.array_equal(banana_2d.make_data(x, y, 1)['x_test'], data['x_test'])
  # The 1000 drawn points are distinct rows of the file.
  both = np.concatenate([data['x_train'], data['x_test']])
  assert np.unique(both, axis=0).shape[0] == 1000


def test_missing_data_is_a_clear_error(tmp_path, monkeypatch):
  monkeypatch.delenv('GEOPARAM_DATA_DIR', raising=False)
  with pytest.raises(ValueError, match='GEOPARAM_DATA_DIR'):
    banana_2d.load_banana(None)
  with pytest.raises(ValueError, match='banana.csv'):
    banana_2d.load_banana(str(tmp_path))


@needs_data
def test_tiny_run_end_to_end(tmp_path):
  """3 epochs, 2 seeds, BN (running statistics tracked), a batch size leaving a remainder."""
  out = banana_2d.run_study(str(tmp_path), ['bn'], data_dir=DATA_DIR, epochs=3,
                            batch_size=64, num_seeds=2, num_points=200, compare_rates=False)
  for name in ('results.json', 'results.csv', 'results.md', 'trajectories.png',
               'angle_change.png', 'decision_boundaries.png'):
    assert (tmp_path / name).stat().st_size > 0, name
  summary = json.loads((tmp_path / 'results.json').read_text())
  assert set(summary['test_accuracy']) == {'bn'}
  assert any('highest test accuracy' in k for k in summary['claims'])
  for m, r in out['results'].items():
    assert r['steps_per_epoch'] == 3  # 160 training points: 2 batches of 64 + 32
    assert r['locations'].shape == (2, 3 * 3 + 1, 10, 2)
    assert np.all(np.isfinite(r['locations']))
    assert 0.0 <= summary['test_accuracy'][m] <= 1.0
    # The per-step summaries are those of the recorded locations.
    expected = np.max(np.linalg.norm(np.diff(r['locations'], axis=1), axis=3), axis=2)
    active = np.isfinite(r['max_dphi'])
    np.testing.assert_allclose(r['max_dphi'][active], expected[active], rtol=1e-10)
    assert np.all(r['max_dtheta_deg'][active] >= 0) and np.all(r['max_dtheta_deg'] <= 180)
  # The reported final locations are those of the returned (best) parameters, BN folded with
  # its running statistics.
  r = out['results']['bn']
  variables = {'params': jax.tree.map(lambda a: a[0], r['final_params']),
               **jax.tree.map(lambda a: a[0], r['final_others'])}
  with jax.enable_x64(True):
    phi = analysis.boundary_location(
        analysis.layer_variables(variables, 'bn', bn_epsilon=1e-3), 'bn')
  np.testing.assert_allclose(r['final_phi'][0], phi, rtol=1e-12)


@needs_data
def test_cli(tmp_path):
  workdir = tmp_path / 'banana'
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.banana_2d', f'--data_dir={DATA_DIR}',
       f'--workdir={workdir}', '--epochs=2', '--num_seeds=1', '--methods=sp',
       '--num_points=100', '--batch_size=32', '--compare_rates=false'],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert '| sp* |' in proc.stdout and 'paper claim' in proc.stdout
  assert json.loads((workdir / 'results.json').read_text())['epochs_run']['sp'] == [2]
  bad = subprocess.run(
      [sys.executable, '-m', 'experiments.banana_2d', f'--data_dir={tmp_path}',
       f'--workdir={workdir}'], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert bad.returncode != 0 and 'banana.csv' in bad.stderr
  with pytest.raises(ValueError, match='batch_size=128 exceeds the 80'):
    banana_2d.run_study(str(workdir), ['sp'], data_dir=DATA_DIR, num_points=100)
