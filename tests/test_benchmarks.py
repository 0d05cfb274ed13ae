"""The benchmark command runs on tiny shapes (no timing assertions: speed lives in benchmarks/)."""

import json

import pytest

from benchmarks import layers


def test_benchmark_runs_on_tiny_shapes_and_writes_json(tmp_path):
  out = tmp_path / 'bench.json'
  cases = ['gmp_dense_b256', 'gmp_imn_dense_b1024', 'gmp_conv_128c_32px', 'lcw_dense_b1024', 'map']
  rows = layers.run(cases, tiny=True, repeats=1, out=str(out))
  assert [r['case'] for r in rows] == cases
  for row in rows:
    assert row['layer_ms'] > 0 and row['baseline_ms'] > 0
    assert row['ratio'] == pytest.approx(row['layer_ms'] / row['baseline_ms'])
  saved = json.loads(out.read_text())
  assert saved['tiny'] is True and len(saved['rows']) == len(cases)


def test_every_case_name_is_listed_and_unknown_names_fail():
  assert len(set(layers.CASE_NAMES)) == len(layers.CASE_NAMES)
  with pytest.raises(ValueError, match='accepted'):
    layers.run(['gmp_dense'], tiny=True, repeats=1)
