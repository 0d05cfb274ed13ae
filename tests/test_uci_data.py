"""The UCI loader: every shared file, other column counts, bad input, splits, standardization."""

import os

import numpy as np
import pytest

from experiments.data import uci_data
from experiments.studies import uci_regression

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.environ.get(uci_data.ENV_VAR) or os.path.join(ROOT, '..', 'shared', 'data')

# shared/data/README.md: rows, features.
SHAPES = dict(boston=(506, 13), concrete=(1030, 8), energy=(768, 8), power=(9568, 4),
              wine=(1599, 11), yacht=(308, 6))


def _write(tmp_path, name, text):
  folder = tmp_path / 'uci'
  folder.mkdir(exist_ok=True)
  (folder / f'{name}.txt').write_text(text)
  return str(tmp_path)


def test_every_shared_file_loads():
  names = uci_data.available(DATA_DIR)
  assert set(SHAPES) <= set(names), names
  for name in names:
    ds = uci_data.load(name, DATA_DIR)
    n = ds.x.shape[0]
    assert ds.x.ndim == 2 and ds.y.shape == (n,), name
    assert ds.x.dtype == np.float64
    assert np.all(np.isfinite(ds.x)) and np.all(np.isfinite(ds.y)), name
    if name in SHAPES:
      assert ds.x.shape == SHAPES[name], name
    # Targets are the last column: not a constant, and not equal to any feature column.
    assert np.std(ds.y) > 0


def test_generated_file_with_another_column_count(tmp_path):
  rows = np.arange(21, dtype=np.float64).reshape(7, 3) * 0.5 - 2.0
  lines = ['', '  ' + '\t'.join(f'{v:g}' for v in rows[0])]
  lines += ['   '.join(f'{v:g}' for v in r) + ' ' for r in rows[1:4]]
  lines += ['', '\t \t']
  lines += ['\t'.join(f'{v:.3e}' for v in r) for r in rows[4:]]
  data_dir = _write(tmp_path, 'toy', '\n'.join(lines) + '\n\n')
  ds = uci_data.load('toy', data_dir)
  np.testing.assert_array_equal(ds.x, rows[:, :2])
  np.testing.assert_array_equal(ds.y, rows[:, 2])
  assert ds.last_line == 10
  # The folder holding the .txt files works too, and so does the environment variable.
  np.testing.assert_array_equal(uci_data.load('toy', os.path.join(data_dir, 'uci')).x, ds.x)


def test_environment_variable(tmp_path, monkeypatch):
  data_dir = _write(tmp_path, 'toy', '1 2 3\n4 5 6\n')
  monkeypatch.setenv(uci_data.ENV_VAR, data_dir)
  assert uci_data.load('toy').x.shape == (2, 2)
  monkeypatch.delenv(uci_data.ENV_VAR)
  with pytest.raises(ValueError, match='--config.data_dir.*GEOPARAM_DATA_DIR'):
    uci_data.load('toy')


@pytest.mark.parametrize('text, match', [
    ('1 2 3\n4 5 6\n7\n', r'line 3: 1 column'),
    ('1 2 3\n\n4 x 6\n', r"line 3: non-numeric cell 'x'"),
    ('1 2 3\n4 5 6 7\n', r'line 2: 4 columns, but line 1 has 3'),
    ('\n\n', r'no data rows'),
])
def test_bad_files_name_the_line(tmp_path, text, match):
  data_dir = _write(tmp_path, 'bad', text)
  with pytest.raises(ValueError, match=match):
    uci_data.load('bad', data_dir)


def test_too_few_rows_for_the_splits(tmp_path):
  data_dir = _write(tmp_path, 'tiny', '\n1 2\n3 4\n5 6\n')
  ds = uci_data.load('tiny', data_dir)
  uci_regression.prepare(ds, 'reference', 2, 0)  # 2 fit rows, 1 test row: enough
  with pytest.raises(ValueError, match=r'tiny.txt \(last data row at line 4\).*3 rows is too few'):
    uci_regression.prepare(ds, 'clean', 2, 0)


def test_missing_directory_and_unknown_dataset(tmp_path):
  with pytest.raises(ValueError, match='--config.data_dir.*does not exist'):
    uci_data.load('yacht', str(tmp_path / 'nowhere'))
  (tmp_path / 'other.csv').write_text('1,2\n')
  with pytest.raises(ValueError, match=r"--config.data_dir.*holds 1 entry: other.csv\."):
    uci_data.load('yacht', str(tmp_path))
  with pytest.raises(ValueError, match='--config.datasets.*no file nope.txt.*boston, concrete'):
    uci_data.load('nope', DATA_DIR)
  with pytest.raises(ValueError, match=r"^unknown datasets \['nope'\].*yacht"):
    uci_data.check_datasets(['yacht', 'nope'], DATA_DIR)
  with pytest.raises(ValueError, match="does not exist. Pass --config.download=True to fetch "
                                       "boston, concrete, energy, power, wine, yacht from their"):
    uci_data.check_datasets(['yacht'], str(tmp_path / 'nowhere'))
  # A folder of the user's own files only: a paper dataset missing there gets the download hint.
  (tmp_path / 'mine.txt').write_text('1 2\n3 4\n')
  with pytest.raises(ValueError, match=r"unknown datasets \['yacht', 'nope'\]; valid \(files in "
                                       r".*\): mine\. Pass --config.download=True to fetch "
                                       r"yacht from its public source\.$"):
    uci_data.check_datasets(['yacht', 'nope'], str(tmp_path))
  with pytest.raises(ValueError, match=r"\['nope'\]; valid \(files in .*\): mine\.$"):
    uci_data.check_datasets(['nope'], str(tmp_path))
  assert uci_data.check_datasets(['yacht'], str(tmp_path), download=True) == ('yacht',)


def test_splits_partition_the_rows():
  s = uci_data.make_splits(308, 4, seed=3, val_fraction=0.2)
  assert s.test.shape == (4, 62) and s.val.shape == (4, 50) and s.fit.shape == (4, 196)
  for i in range(4):
    rows = np.concatenate([s.fit[i], s.val[i], s.test[i]])
    np.testing.assert_array_equal(np.sort(rows), np.arange(308))
  assert not np.array_equal(s.test[0], s.test[1])
  # Split i depends only on (seed, i), not on how many splits are drawn.
  np.testing.assert_array_equal(uci_data.make_splits(308, 2, seed=3, val_fraction=0.2).test,
                                s.test[:2])
  with pytest.raises(ValueError, match='--config.num_splits'):
    uci_data.make_splits(308, 0, seed=0)


def test_standardize_uses_training_statistics_only():
  rng = np.random.default_rng(0)
  x_fit = rng.normal(3.0, 2.0, size=(50, 3))
  x_fit[:, 2] = 7.0  # constant column
  x_test = rng.normal(-5.0, 9.0, size=(20, 3))
  fit, test = uci_data.standardize(x_fit, x_test)
  np.testing.assert_allclose(fit[:, :2].mean(0), 0, atol=1e-12)
  np.testing.assert_allclose(fit[:, :2].std(0), 1, atol=1e-12)
  np.testing.assert_allclose(test[:, :2], (x_test[:, :2] - x_fit[:, :2].mean(0))
                             / x_fit[:, :2].std(0), atol=1e-12)
  assert np.all(np.isfinite(fit)) and np.all(fit[:, 2] == 0)
  np.testing.assert_allclose(test[:, 2], x_test[:, 2] - 7.0)
  # Changing the test rows changes nothing in the training rows.
  fit2, _ = uci_data.standardize(x_fit, x_test * 100 + 1)
  np.testing.assert_array_equal(fit, fit2)


@pytest.mark.parametrize('protocol', ['reference', 'clean'])
def test_prepare_standardizes_with_the_fit_rows(protocol):
  ds = uci_data.load('yacht', DATA_DIR)
  data = uci_regression.prepare(ds, protocol, 3, seed=1)
  s = uci_data.make_splits(len(ds.y), 3, 1, val_fraction=0.2 if protocol == 'clean' else 0.0)
  mon = s.val if protocol == 'clean' else s.test
  for i in range(3):
    raw = ds.x[s.fit[i]]
    mean, std = raw.mean(0), raw.std(0)
    np.testing.assert_allclose(data['x_fit'][i], (raw - mean) / std, atol=1e-12)
    np.testing.assert_allclose(data['x_mon'][i], (ds.x[mon[i]] - mean) / std, atol=1e-12)
    np.testing.assert_allclose(data['x_test'][i], (ds.x[s.test[i]] - mean) / std, atol=1e-12)
    np.testing.assert_array_equal(data['y_test'][i, :, 0], ds.y[s.test[i]])
    # The test rows never enter the statistics: they differ from all-rows statistics.
    assert not np.allclose(mean, ds.x[np.concatenate([s.fit[i], s.test[i]])].mean(0))
  assert data['x_fit'].shape == (3, len(s.fit[0]), 6)
  if protocol == 'clean':
    assert data['x_mon'].shape[1] == len(s.val[0]) > 0
  else:
    np.testing.assert_array_equal(data['x_mon'], data['x_test'])
