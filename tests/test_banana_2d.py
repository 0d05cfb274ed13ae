"""The Banana study: data protocol, the smoke config through experiments.main (its table equal
to the one the study gave before it moved onto experiments.lib.protocol), a tiny run, the command line."""

import json
import os

import jax
import numpy as np
import pytest

from experiments.studies import banana_2d
from experiments import main
from experiments.lib import models
from geoparam import analysis
from tests import cli_fork

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
  """3 epochs, 2 seeds, BN (running statistics tracked), a batch size leaving a remainder (the
  figures: the smoke run below)."""
  out = main.run_study('banana_2d', str(tmp_path), methods=['bn'], data_dir=DATA_DIR,
                       num_epochs=3, batch_size=64, num_seeds=2, num_points=200,
                       compare_rates=False, plots=False)
  for name in ('results.json', 'results.csv', 'results.md'):
    assert (tmp_path / name).stat().st_size > 0, name
  assert not (tmp_path / 'trajectories.png').exists()
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
        models.layer_variables(variables, 'bn', bn_epsilon=1e-3), 'bn')
  np.testing.assert_allclose(r['final_phi'][0], phi, rtol=1e-12)


# `results.md` of the `:smoke` config (150 epochs, 2 seeds, patience 10/20, both rates, float64),
# produced by the study before it moved onto experiments.lib.protocol (commit 50c0029,
# `python -m experiments.studies.banana_2d --workdir=/tmp/banana_old --epochs=150 --num_seeds=2
# --plateau_patience=10 --stop_patience=20`, 2026-11-24). The port must give it to the printed
# digits.
EXPECTED_SMOKE_TABLE = """\
| method | lr | test accuracy (mean +- s.e.) | per seed | epochs run | max_t max_i abs(dtheta) (deg) | max_t max_i abs(dphi) |
| --- | --- | --- | --- | --- | --- | --- |
| sp* | 0.01 | 0.7900 +- 0.0400 | 0.830, 0.750 | 74, 48 | 4.83 | 0.107 |
| sp | 0.1 | 0.8750 +- 0.0000 | 0.875, 0.875 | 44, 41 | 93.55 | 3.43 |
| wn* | 0.01 | 0.8125 +- 0.0425 | 0.855, 0.770 | 105, 63 | 1.06 | 0.0169 |
| wn | 0.1 | 0.8800 +- 0.0050 | 0.885, 0.875 | 48, 64 | 8.66 | 0.264 |
| bn* | 0.01 | 0.8150 +- 0.0250 | 0.840, 0.790 | 99, 71 | 5.67 | 0.0721 |
| bn | 0.1 | 0.8450 +- 0.0550 | 0.900, 0.790 | 71, 70 | 39.87 | 0.512 |
| gmp | 0.01 | 0.7975 +- 0.0425 | 0.840, 0.755 | 71, 55 | 0.84 | 0.0155 |
| gmp* | 0.1 | **0.8450 +- 0.0400** | 0.805, 0.885 | 41, 50 | 6.10 | 0.108 |

`*`: the protocol rate of the method (lr 0.1 GmP, 0.01 others by default).
"""


@needs_data
def test_smoke_config_runs_through_main_and_gives_the_stored_table(tmp_path):
  """~20 s on 2 cores: 4 methods x 2 rates, each stopping early (plateau and restore-best)."""
  workdir = tmp_path / 'banana'
  proc = cli_fork.run_main(  # python -m experiments.main in a forked child (tests/cli_fork.py)
      ['--config=experiments/configs/banana_2d.py:smoke', f'--workdir={workdir}',
       f'--config.data_dir={DATA_DIR}'])
  assert proc.returncode == 0, proc.stderr[-3000:]
  md = (workdir / 'results.md').read_text()
  assert md.startswith(EXPECTED_SMOKE_TABLE + '\n') and '- GmP has the highest test accuracy' in md
  assert EXPECTED_SMOKE_TABLE in proc.stdout and 'paper claim' in proc.stdout
  assert json.loads((workdir / 'config.json').read_text())['study'] == 'banana_2d'
  summary = json.loads((workdir / 'results.json').read_text())
  assert set(summary['by_learning_rate']['test_accuracy']) == {'0.01', '0.1'}
  assert any('highest test accuracy' in k for k in summary['claims'])
  for name in ('results.csv', 'trajectories.png', 'angle_change.png', 'decision_boundaries.png'):
    assert (workdir / name).stat().st_size > 0, name


@needs_data
def test_cli_refuses_bad_settings_creating_nothing(tmp_path):
  """`python -m experiments.main` with the Banana config and no data: one line, exit 2 (the smoke
  test above runs the command line to the end)."""
  bad = cli_fork.run_main(  # python -m experiments.main in a forked child (tests/cli_fork.py)
      ['--config=experiments/configs/banana_2d.py', f'--config.data_dir={tmp_path}',
       f'--workdir={tmp_path / "new"}'])
  assert bad.returncode == 2 and bad.stderr.count('\n') == 1, bad.stderr
  assert 'banana.csv not found' in bad.stderr and not (tmp_path / 'new').exists()
  with pytest.raises(ValueError, match='must leave at least batch_size=128 training points'):
    main.run_study('banana_2d', str(tmp_path / 'new'), methods=['sp'], data_dir=DATA_DIR,
                   num_points=100)
  assert not (tmp_path / 'new').exists()


def test_claims_about_diverged_runs_get_no_verdict():
  def run(peak, loss):
    return {'max_dtheta_deg': np.array([[1.0, peak]]), 'test_acc': np.array([0.5]),
            'trace': {'loss': np.array([[0.7, loss, 0.1]]), 'active': np.array([[1, 1, 0]], bool)}}
  fine = banana_2d.check_claims({'sp': run(170.0, 0.5), 'gmp': run(2.0, 0.5)})
  assert fine['sp: max_i |dtheta| jumps up to 180 deg at some step at the protocol rates'] == (
      'holds (max 170.0 deg)')
  # A NaN loss in an epoch that ran (not in the inactive one) takes every verdict away.
  diverged = banana_2d.check_claims({'sp': run(170.0, np.nan), 'gmp': run(2.0, 0.5)})
  assert diverged['sp: max_i |dtheta| jumps up to 180 deg at some step at the protocol rates'] \
      .startswith('not measured')
  assert diverged['GmP has the highest test accuracy (protocol rates)'].startswith('not measured')
  inactive_nan = banana_2d.check_claims({'sp': run(170.0, 0.5), 'gmp': {
      **run(2.0, 0.5), 'trace': {'loss': np.array([[0.7, 0.5, np.nan]]),
                                 'active': np.array([[1, 1, 0]], bool)}}})
  assert inactive_nan == fine
