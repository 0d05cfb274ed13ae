"""experiments.lib.report: the files every study writes and the claims' NaN guard."""

import csv
import json
import math
import os

import numpy as np
import pytest

from experiments.lib import report


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


def test_cells_and_bold():
  assert report.format_pair(0.8, 0.15, 2) == '0.80 +- 0.15'
  assert report.format_pair(0.8, None, 2) == '0.80'
  assert report.format_pair(0.8, float('nan'), 1) == '0.8 +- nan'
  assert report.format_mean_se([1.0, 3.0], 1) == report.format_pair(2.0, 1.0, 1) == '2.0 +- 1.0'
  assert report.format_values(np.array([1.0, 0.25])) == '1.000, 0.250'
  assert report.format_values(np.array([300, 41], np.int32), 'd') == '300, 41'
  assert report.bold('x') == '**x**' and report.bold('x', False) == 'x'
  assert report.mean_se([2.0], single=float('nan'))[1] != report.mean_se([2.0])[1]
  assert math.isnan(report.mean_se([2.0], single=float('nan'))[1])
  assert report.mean_se([1.0, 3.0], single=float('nan')) == (2.0, 1.0)


def test_max_over_members_ignores_stopped_members():
  v = np.array([[1.0, 5.0, np.nan, np.nan, np.nan],
                [2.0, np.nan, 7.0, np.nan, np.nan]], np.float32)
  got = report.max_over_members(v)
  assert got.dtype == np.float64 and got.shape == (5,)
  np.testing.assert_array_equal(got, [2.0, 5.0, 7.0, np.nan, np.nan])
  np.testing.assert_array_equal(report.max_over_members(np.full((2, 3, 4), np.nan)),
                                np.full((3, 4), np.nan))


def test_collect_and_member_rows():
  runs = {'sp': np.array([1.0, 3.0]), 'gmp': np.array([0.5, 0.7])}
  got = report.collect(runs, mean=lambda r: float(np.mean(r)), first=lambda r: r[0])
  assert got == {'mean': {'sp': 2.0, 'gmp': 0.6}, 'first': {'sp': 1.0, 'gmp': 0.5}}
  assert list(got['mean']) == ['sp', 'gmp']
  nested = report.collect({'0.1': runs, '0.01': {'sp': runs['sp']}}, depth=2, n=len)
  assert nested == {'n': {'0.1': {'sp': 2, 'gmp': 2}, '0.01': {'sp': 2}}}
  rows = report.member_rows([({'method': 'sp', 'lr': 0.1}, runs['sp']),
                             ({'method': 'gmp', 'lr': 0.1}, runs['gmp'])], 'seed',
                            rmse=lambda r: r, best=lambda r: float(np.min(r)), tag=lambda r: 'x')
  assert [list(r) for r in rows] == [['method', 'lr', 'seed', 'rmse', 'best', 'tag']] * 4
  assert [(r['method'], r['seed'], r['rmse'], r['best'], r['tag']) for r in rows] == [
      ('sp', 0, 1.0, 1.0, 'x'), ('sp', 1, 3.0, 1.0, 'x'), ('gmp', 0, 0.5, 0.5, 'x'),
      ('gmp', 1, 0.7, 0.5, 'x')]
