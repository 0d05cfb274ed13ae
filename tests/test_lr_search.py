"""Learning-rate cross-validation (`experiments.lib.lr_search`, `lr_selection=cv` of the studies):
the folds, the selection rule, CV never seeing the test split, a run through experiments.main,
refused settings."""

import json
import math
import os

import jax
import ml_collections
import numpy as np
import pytest

from experiments import main
from experiments.configs import validate
from experiments.data import uci_data
from experiments.lib import lr_search
from experiments.studies import uci_regression as ur
from tests import cli_fork

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.environ.get(uci_data.ENV_VAR) or os.path.join(ROOT, '..', 'shared', 'data')


def test_folds_partition_the_training_indices_and_never_hold_test_rows():
  ds = uci_data.load('yacht', DATA_DIR)
  for protocol in ('reference', 'clean'):
    splits = uci_data.make_splits(len(ds.y), 3, 0, ur.TEST_FRACTION,
                                  ur.VAL_FRACTION if protocol == 'clean' else 0.0)
    data, folds = ur.prepare_cv(ds, protocol, 3, 0, 4)
    n = splits.fit.shape[1]
    assert folds.shape == (3, 4, n // 4)
    assert data['x_fit'].shape[:3] == (3, 4, n - n // 4)
    for i in range(3):
      held = folds[i]
      # Disjoint folds inside the fit rows; the n % K leftover rows are in no fold.
      assert len(np.unique(held)) == held.size == 4 * (n // 4)
      assert set(held.ravel()) <= set(splits.fit[i])
      assert not set(held.ravel()) & set(splits.test[i]) and not set(held.ravel()) & set(
          splits.val[i])
      fits = lr_search.fit_parts(splits.fit[i], held)
      for k in range(4):
        assert sorted(set(fits[k]) | set(held[k])) == sorted(splits.fit[i])
        # The fold's arrays are those rows (targets are not scaled).
        np.testing.assert_array_equal(data['y_test'][i, k, :, 0], ds.y[held[k]])
        np.testing.assert_array_equal(data['y_fit'][i, k, :, 0], ds.y[fits[k]])
        want_mon = held[k] if protocol == 'reference' else splits.val[i]
        np.testing.assert_array_equal(data['y_mon'][i, k, :, 0], ds.y[want_mon])
        np.testing.assert_allclose(data['x_fit'][i, k].mean(0), 0, atol=1e-9)
    # Deterministic from the seed; another seed, other folds.
    np.testing.assert_array_equal(ur.prepare_cv(ds, protocol, 3, 0, 4)[1], folds)
    assert not np.array_equal(ur.prepare_cv(ds, protocol, 3, 1, 4)[1], folds)
  with pytest.raises(ValueError, match='cv_folds must be in'):
    lr_search.carve_folds(np.arange(5), 6, 0)


def test_the_selection_rule():
  rates = [0.001, 0.01, 0.1]
  s = lr_search.select(rates, [[3.0, 1.0], [1.0, 1.5], [np.nan, 0.1]])
  assert (s.rate, s.index) == (0.01, 1)  # the NaN fold takes 0.1 out despite its 0.1
  assert s.diverged.tolist() == [False, False, True] and math.isnan(s.scores[2])
  np.testing.assert_allclose(s.scores[:2], [2.0, 1.25])
  # Ties go to the smallest rate, whatever the order of the grid.
  assert lr_search.select([0.1, 0.01, 0.03], [[0.5], [0.5], [0.7]]).rate == 0.01
  assert lr_search.select([0.1, 0.01, 0.03], [[0.5], [0.5], [0.7]], mode='max').rate == 0.03
  # inf counts as diverged; all diverged -> NaN and index -1, never a pick.
  none = lr_search.select(rates, [[np.inf, 1.0], [np.nan, np.nan], [1.0, -np.inf]])
  assert math.isnan(none.rate) and none.index == -1 and none.diverged.all()
  with pytest.raises(ValueError, match='mode'):
    lr_search.select(rates, [[1.0]] * 3, mode='best')
  # Per seed (UCI: per split) or pooled over folds and seeds.
  values = np.array([[[1.0, 5.0]], [[2.0, 1.0]]])  # (rates, folds, seeds)
  out = lr_search.search(lambda m: values.ravel(), [0.01, 0.1], 1, 2, 'min', per_seed=True)
  assert [s.rate for s in out['selections']] == [0.01, 0.1]
  assert lr_search.search(lambda m: values.ravel(), [0.01, 0.1], 1, 2, 'min')[
      'selections'][0].rate == 0.1
  assert lr_search.distribution([0.1, 0.01, np.nan, 0.1]) == {'0.01': 1, '0.1': 2, 'nan': 1}
  assert lr_search.modal([0.1, 0.01]) == 0.01 and lr_search.modal([0.1, 0.01, 0.1]) == 0.1
  assert lr_search.paper_claim({'sp': 0.01, 'gmp': 0.1}).startswith('holds')
  assert lr_search.paper_claim({'sp': 0.03, 'gmp': 0.1}).startswith('does not hold')
  assert lr_search.paper_claim({'sp': np.nan, 'gmp': 0.1}).startswith('not measured')


def test_cv_never_sees_the_test_split():
  """Garbage in the test split (targets 1e6, features NaN) moves neither the validation scores
  nor the chosen rate (UCI, the reference protocol, whose monitored split is the test split;
  Levy's and Banana's `cross_validate` take only `x_train`, `y_train`)."""
  ds = uci_data.load('yacht', DATA_DIR)
  # One split: another split's test rows are training rows of this one.
  test_rows = uci_data.make_splits(len(ds.y), 1, 0).test[0]
  y, x = ds.y.copy(), ds.x.copy()
  y[test_rows], x[test_rows] = 1e6, np.nan
  poisoned = ds._replace(x=x, y=y)
  assert np.all(ur.prepare(poisoned, 'reference', 1, 0)['y_mon'] == 1e6)  # the poison is there
  kwargs = dict(hidden=4, plateau_patience=3, stop_patience=6)
  rates = (0.01, 0.1)
  with jax.enable_x64(True):
    keys = ur.split_keys(0, 1)
    got = [ur.cross_validate('sp', ur.prepare_cv(d, 'reference', 1, 0, 2)[0], keys, rates, 25,
                             **kwargs) for d in (ds, poisoned)]
  clean, dirty = got
  assert np.all(np.isfinite(clean['values'])) and clean['values'].shape == (2, 2, 1)
  np.testing.assert_array_equal(clean['values'], dirty['values'])
  assert [s.rate for s in clean['selections']] == [s.rate for s in dirty['selections']]


def test_uci_smoke_with_cv_through_main(tmp_path):
  """`:smoke` (yacht, 3 splits) with lr_selection=cv, shrunk to GmP, 2 rates, 2 folds,
  30 epochs and 8 hidden units; the chosen rates land in results.json and Table 3 gets its CV rows."""
  workdir = tmp_path / 'uci'
  proc = cli_fork.run_main(  # python -m experiments.main in a forked child (tests/cli_fork.py)
      ['--config=experiments/configs/uci_regression.py:smoke', f'--workdir={workdir}',
       f'--config.data_dir={DATA_DIR}', '--config.lr_selection=cv', '--config.lr_grid=0.01,0.1',
       '--config.cv_folds=2', '--config.methods=gmp', '--config.num_epochs=30',
       '--config.hidden=8'])
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((workdir / 'results.json').read_text())
  cv = summary['cv']
  assert cv['lr_grid'] == [0.01, 0.1] and cv['cv_folds'] == 2
  for m in ('gmp',):
    chosen = cv['chosen_lr']['yacht'][m]
    assert len(chosen) == 3 and set(chosen) <= {0.01, 0.1}, chosen
    assert sum(cv['chosen_lr_distribution']['yacht'][m].values()) == 3
    scores = np.array(cv['val_rmse_per_split']['yacht'][m])  # (splits, rates)
    assert scores.shape == (3, 2) and np.all(np.isfinite(scores))
    # Each split's chosen rate has the lowest mean validation RMSE of its folds.
    assert [[0.01, 0.1][int(np.argmin(s))] for s in scores] == chosen
    fixed = [r for r in summary['records'] if r['method'] == m]
    at_cv = [r for r in cv['records'] if r['method'] == m]
    assert [r['lr'] for r in at_cv] == chosen
    assert {r['lr_selection'] for r in fixed} == {'fixed'}
    for f, r in zip(fixed, at_cv):  # the same rate: the same run (up to float32 rounding)
      if r['lr'] == f['lr']:
        np.testing.assert_allclose(r['rmse'], f['rmse'], rtol=1e-5)
  assert any(k.startswith('CV picks 0.1 for GmP') for k in summary['claims'])
  table = (workdir / 'results.md').read_text()
  assert '| GmP, CV lr | ' in table and '| GmP, paper |' in table
  assert '| yacht | GmP | ' in table and 'Learning rates chosen by cross-validation' in table
  assert (workdir / 'results.csv').read_text().count('\n') == 1 + 2 * 3


@pytest.mark.parametrize('study, fields, match', [
    ('uci_regression', dict(lr_grid=()), r'--config.lr_grid=\(\): must be a tuple of finite numbers > 0'),
    ('uci_regression', dict(lr_grid=(0.01, -0.1)), 'finite numbers > 0'),
    ('uci_regression', dict(lr_grid=(0.01, float('nan'))), 'finite numbers > 0'),
    ('uci_regression', dict(lr_grid=(0.01, 0.01)), 'must be distinct'),
    ('uci_regression', dict(cv_folds=1), '--config.cv_folds=1: must be an int >= 2'),
    ('uci_regression', dict(cv_folds=300),
     '--config.cv_folds=300: yacht has 246 training rows; at most 246 folds'),
    ('levy_1d', dict(cv_folds=51), 'the Levy training set has 50 training rows'),
    ('banana_2d', dict(cv_folds=3, num_points=200),
     'the Banana training set has 160 training rows, so a fold.s fit part has 107, fewer than '
     'the 128 it needs; use at least 5 folds'),
])
def test_bad_cv_settings_are_refused_before_any_work(tmp_path, study, fields, match):
  base = dict(uci_regression=dict(datasets='yacht', data_dir=DATA_DIR),
              banana_2d=dict(data_dir=DATA_DIR), levy_1d={})[study]
  with pytest.raises(validate.ConfigError, match=match):
    main.run_study(study, str(tmp_path / 'w'), 'smoke', lr_selection='cv', **base, **fields)
  assert not (tmp_path / 'w').exists()


def test_cv_fields_with_fixed_selection_exit_2_with_nothing_created(tmp_path):
  proc = cli_fork.run_main(  # python -m experiments.main in a forked child (tests/cli_fork.py)
      ['--config=experiments/configs/levy_1d.py:smoke', f'--workdir={tmp_path / "w"}',
       '--config.lr_grid=0.01,0.1'])
  assert proc.returncode == 2 and proc.stderr.count('\n') == 1, proc.stderr
  assert ('--config.lr_grid=(0.01, 0.1): applies only with --config.lr_selection=cv'
          in proc.stderr)
  assert not (tmp_path / 'w').exists()
  config = ml_collections.ConfigDict(dict(lr_selection='fixed', cv_folds=3))
  with pytest.raises(validate.ConfigError, match='cv_folds=3: applies only with'):
    validate.check_config(config, lr_search.CONFIG_RULES)
  with pytest.raises(validate.ConfigError, match='must be one of fixed, cv'):
    validate.check_config(dict(lr_selection='grid'), lr_search.CONFIG_RULES)
