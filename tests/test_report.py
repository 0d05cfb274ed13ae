"""experiments.report: the files every study writes and the claims' NaN guard."""

import csv
import json
import math
import os

import numpy as np
import pytest

from experiments import report


def test_claim_verdicts_and_nan_guard():
  assert report.claim(True, 'x {:.1f}', 1.0) == 'holds (x 1.0)'
  assert report.claim(False, 'x {:.1f}', 1.0) == 'does not hold (x 1.0)'
  for bad in (float('nan'), float('inf'), np.array([1.0, np.nan])):
    verdict = report.claim(True, 'values', bad)
    assert verdict.startswith('not measured') and 'holds' not in verdict


def test_mean_se_against_formula():
  v = np.random.RandomState(0).normal(size=7)
  mean, se = report.mean_se(v)
  assert mean == pytest.approx(sum(v) / 7)
  assert se == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in v) / 6 / 7))
  assert report.mean_se([3.0]) == (3.0, None)
  assert report.format_mean_se([3.0]) == '3.0000'
  with pytest.raises(ValueError):
    report.mean_se([])


def test_write_files(tmp_path, capsys):
  rows = [dict(method='sp', seed=0, rmse=np.float32(1.5)), dict(method='gmp', seed=0, rmse=0.5)]
  claims = {'GmP lowest': report.claim(True, 'gmp {:.2f}', 0.5)}
  out = report.write(str(tmp_path / 'w'), 'toy', summary={'rmse': {'sp': np.array([1.5])}},
                     rows=rows, table=report.markdown_table(['m'], [['sp']]), claims=claims,
                     config={'seed': 0}, started=0.0, figures=['a.png'], paper={'sp': 1.2})
  with open(tmp_path / 'w' / 'results.json') as f:
    assert json.load(f) == out
  assert out['rmse'] == {'sp': [1.5]} and out['claims'] == claims and out['paper'] == {'sp': 1.2}
  assert out['config'] == {'seed': 0} and out['wall_seconds'] > 0
  with open(tmp_path / 'w' / 'results.csv') as f:
    got = list(csv.reader(f))
  assert got == [['method', 'seed', 'rmse'], ['sp', '0', '1.5'], ['gmp', '0', '0.5']]
  md = (tmp_path / 'w' / 'results.md').read_text()
  assert '| sp |' in md and '- GmP lowest: holds (gmp 0.50)' in md
  printed = capsys.readouterr().out
  assert '[toy] paper claim: GmP lowest: holds' in printed and 'a.png' in printed


def test_write_refuses_ragged_rows(tmp_path):
  with pytest.raises(ValueError, match='share the keys'):
    report.write(str(tmp_path), 'toy', summary={}, rows=[{'a': 1}, {'b': 2}], table='',
                 claims={}, quiet=True)
  with pytest.raises(ValueError, match='cells'):
    report.markdown_table(['a', 'b'], [[1]])
  assert os.path.exists(tmp_path)
