"""The benchmark command runs on tiny shapes (no timing assertions: speed lives in benchmarks/)."""

import json

import jax
import numpy as np
import pytest

from geoparam import native

from benchmarks import layers


def test_benchmark_runs_on_tiny_shapes_and_writes_json(tmp_path):
  out = tmp_path / 'bench.json'
  cases = ['gmp_dense_b256', 'gmp_imn_dense_b1024', 'gmp_conv_128c_32px', 'lcw_dense_b1024', 'map',
           'map_4608x512']
  rows = layers.run(cases, tiny=True, repeats=1, out=str(out))
  assert [r['case'] for r in rows] == cases
  for row in rows:
    assert row['layer_ms'] > 0 and row['baseline_ms'] > 0
    # repeats=1: the median of per-round ratios is the one round's ratio of the medians.
    assert row['ratio'] == pytest.approx(row['layer_ms'] / row['baseline_ms'])
  for row in rows[-2:]:
    assert row['bare_scans_ms'] > 0 and row['jnp_floor_ms'] > 0 and row['cumprod_ms'] > 0
  saved = json.loads(out.read_text())
  assert saved['tiny'] is True and len(saved['rows']) == len(cases)


def test_benchmark_runs_in_bfloat16_with_float32_params(tmp_path):
  out = tmp_path / 'bench.json'
  cases = ['gmp_dense_b1024', 'gmp_imn_conv_256c_16px', 'gmp_imn_wrap_conv_128c_32px']
  rows = layers.run(cases, tiny=True, repeats=1, out=str(out), dtype='bfloat16')
  assert [r['case'] for r in rows] == cases and all(r['dtype'] == 'bfloat16' for r in rows)
  assert json.loads(out.read_text())['dtype'] == 'bfloat16'
  with pytest.raises(ValueError, match='accepted: float32, bfloat16'):
    layers.run(cases, tiny=True, repeats=1, dtype='float16')


def test_vision_throughput_runs_on_a_tiny_model_in_bfloat16(tmp_path):
  from benchmarks import vision_throughput
  out = tmp_path / 'vgg6.json'
  # Plain and the paper form (GmP+IMN convolutions; the wrapper the whole-model transform
  # builds runs in bfloat16 in test_wrappers.py).
  timed = ('sp', 'gmp_imn')
  (row,) = vision_throughput.run(['vgg6'], tiny=True, repeats=1, out=str(out), dtype='bfloat16',
                                 image=12, parameterizations=timed)
  assert row['dtype'] == 'bfloat16' and row['image'] == [12, 12, 3]
  assert all(row[f'{p}_images_per_s'] > 0 and row[f'{p}_compile_s'] > 0 for p in timed)
  # Each timed parameterization against plain (sp) and BN, where timed; with one round the
  # ratio of the per-round times is the ratio of the medians.
  assert {k for k in row if '_vs_' in k} == {f'{p}_vs_sp{c}' for p in timed[1:]
                                             for c in ('', '_compile', '_compile_cpu')}
  for p in timed[1:]:
    assert row[f'{p}_vs_sp'] == pytest.approx(row['sp_ms'] / row[f'{p}_ms'])
    assert row[f'{p}_vs_sp_compile'] == pytest.approx(row[f'{p}_compile_s'] / row['sp_compile_s'])
    assert row[f'{p}_vs_sp_compile_cpu'] == pytest.approx(row[f'{p}_compile_cpu_s'] /
                                                          row['sp_compile_cpu_s'])
  assert 'bn_ms' not in row and 'ratio' not in row  # GmP+IMN / BN only when BN is timed
  assert json.loads(out.read_text())['dtype'] == 'bfloat16'
  with pytest.raises(ValueError, match='accepted: float32, bfloat16'):
    vision_throughput.run(['vgg6'], tiny=True, dtype='float16')
  with pytest.raises(ValueError, match=r'accepted \(each once\): sp, bn, gmp, gmp_imn'):
    vision_throughput.run(['vgg6'], tiny=True, parameterizations=('bn', 'bn'))
  with pytest.raises(ValueError, match=r"bad parameterizations \['lcw'\]"):
    vision_throughput.run(['vgg6'], tiny=True, parameterizations=('lcw',))


def test_vision_throughput_times_the_map_as_scans_beside_the_default():
  from benchmarks import vision_throughput
  from geoparam import hyperspherical
  theta = np.ones((26, 8), np.float32)

  def hlo():  # a new function each time: traced anew
    step = jax.jit(lambda t: hyperspherical.to_cartesian_batched(t))
    return step.lower(theta).compile().as_text()

  with vision_throughput._scans(True):
    assert ' while(' in hlo()
  assert (' while(' in hlo()) == (not native.available() and jax.default_backend() == 'cpu')
  (row,) = vision_throughput.run(['vgg6'], tiny=True, repeats=1,
                                 parameterizations=('bn', 'gmp_imn', 'gmp_imn_scans'))
  assert row['gmp_imn_scans_vs_bn'] > 0 and row['gmp_imn_scans_compile_cpu_s'] > 0


def test_every_case_name_is_listed_and_unknown_names_fail():
  assert len(set(layers.CASE_NAMES)) == len(layers.CASE_NAMES)
  with pytest.raises(ValueError, match='accepted'):
    layers.run(['gmp_dense'], tiny=True, repeats=1)


def test_paired_ratio_is_the_median_of_per_round_ratios():
  layer = np.array([2.0, 9.0, 3.0])  # round 2 hit a slow patch of the machine in both
  base = np.array([1.0, 6.0, 1.0])
  assert layers._paired_ratio(layer, base) == pytest.approx(2.0)  # ratios 2, 1.5, 3


def test_interleaved_times_every_thunk_in_turns():
  calls = []
  times = layers._interleaved([lambda: calls.append('a'), lambda: calls.append('b')], repeats=3)
  assert times.shape == (2, 3) and (times >= 0).all()
  assert calls == ['a', 'b'] * 4  # one warm-up round, then 3 timed rounds


def test_eager_benchmark_runs_on_tiny_shapes_and_writes_json(tmp_path):
  from benchmarks import eager
  out = tmp_path / 'eager.json'
  names = ['GmPDense', 'GmP(Conv)', 'nnx:GmPLinear+IMN', 'nnx:GmP(Conv)']  # linen and NNX
  rows = eager.run(names, tiny=True, repeats=2, out=str(out))
  assert [r['case'] for r in rows] == names
  for row in rows:
    for what in ('init', 'apply'):
      assert row[f'layer_{what}_ms'] > 0 and row[f'baseline_{what}_ms'] > 0
      assert row[f'{what}_ratio'] > 0
  assert json.loads(out.read_text())['tiny'] is True
  with pytest.raises(ValueError, match='accepted'):
    eager.run(['GmPDence'], tiny=True, repeats=1)


def test_model_map_runs_on_tiny_models_and_writes_json(tmp_path):
  from benchmarks import model_map
  out = tmp_path / 'map.json'
  rows = model_map.run(('resnet50', 'vgg6'), repeats=2, tiny=True, out=str(out))
  saved = json.loads(out.read_text())['rows']
  assert [r['model'] for r in saved] == ['resnet50', 'vgg6'] and saved == rows
  for r in rows:  # every GmP layer's angles are counted: fan_in - 1 per output channel
    shapes = model_map.thetas_of(r['model'], tiny=True)
    assert r['layers'] == len(shapes) >= 2
    assert r['angles'] == sum(int(np.prod(s.shape)) for s in shapes) > 0
    assert r['compile_s'] > 0 and 0 < r['min_ms'] <= r['ms']
  with pytest.raises(ValueError, match='unknown models'):
    model_map.run(('resnet51',), tiny=True)


def test_model_map_forms_agree_and_report_ops_and_floor():
  from benchmarks import model_map
  # One theta of shape (63, 64): the library's schemes (the native kernels where they build) and
  # the experimental window form (cumprod and one variadic reduce-window), whose gradients must
  # agree with the first's.
  maps = ('sequential', 'associative', 'window') + (('native',) if native.available() else ())
  rows = model_map.run(('63x64',), repeats=1, maps=maps, bandwidth_gbs=100.0)
  assert tuple(r['map'] for r in rows) == maps
  for r in rows:
    assert r['layers'] == 1 and r['angles'] == 63 * 64 and r['floor_bytes'] == 20 * 63 * 64
    assert r['floor_ms'] == pytest.approx(1e3 * r['floor_bytes'] / 100e9)
    assert r['stablehlo_ops'] > 0 and r['hlo_instructions'] > 0
  assert all(r['grad_diff'] < 1e-6 for r in rows[1:])
  assert rows[2]['stablehlo_ops'] < rows[1]['stablehlo_ops'] / 4  # one op per recurrence
  with pytest.raises(ValueError, match='unknown maps'):
    model_map.run(('63x64',), maps=('cumprod',))
