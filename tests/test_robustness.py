"""The robustness study (issue 27): its statistic, its claims, its grid, its init scales, a run
through `experiments.main` and its refusals. Tiny grids and few epochs throughout."""

import json
import math
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from experiments import main
from experiments.configs import validate
from experiments.lib import models
from experiments.studies import banana_2d
from experiments.studies import robustness as rob
from tests import cli_fork
from tests import fixtures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.environ.get('GEOPARAM_DATA_DIR') or os.path.join(ROOT, '..', 'shared', 'data')
needs_data = pytest.mark.skipif(
    not os.path.exists(os.path.join(DATA_DIR, 'banana.csv')) or
    not os.path.exists(os.path.join(DATA_DIR, 'uci', 'yacht.txt')),
    reason=f'banana.csv or uci/yacht.txt not in {DATA_DIR} (set GEOPARAM_DATA_DIR)')
NAN, INF = math.nan, math.inf


def test_sensitivity_against_a_hand_computation():
  # Cells 0.5, 0.2, NaN (-> init 1.0), 3.0 (-> capped at 1.0): best 0.2; mean(0.3, 0, .8, .8).
  assert rob.sensitivity([0.5, 0.2, NAN, 3.0], 1.0) == pytest.approx(0.475)
  # Per-cell initial losses (init scales, widths): capped 0.5, 0.2, 0.6 (inf -> its init), 0.4;
  # best 0.2 -> mean(0.3, 0.0, 0.4, 0.2).
  assert rob.sensitivity([0.5, 0.2, INF, 0.9], [1.0, 1.0, 0.6, 0.4]) == pytest.approx(0.225)
  # A cell with a non-finite loss and initial value carries nothing: mean(0.3, 0) over 2 cells.
  assert rob.sensitivity([0.5, 0.2, NAN], [1.0, 1.0, NAN]) == pytest.approx(0.15)
  # Every cell above its init (Wortsman's min(l, l0) - min l would be < 0): 0, never negative.
  assert rob.sensitivity([2.0, 3.0], 1.0) == 0.0
  assert math.isnan(rob.sensitivity([NAN, INF, -INF], 1.0))
  assert rob.sensitivity([0.7], 1.0) == 0.0
  # The divergence rule.
  np.testing.assert_array_equal(
      rob.diverged([0.1, NAN, 2.1, 1.9, 1.0], [1.0] * 5, [False, False, False, False, True], 2.0),
      [False, True, True, False, True])


def _stats(best_lr, lr_sens=0.1, scale_test=0.1, width_test=0.1):
  return dict(best_lr=best_lr, lr_sensitivity=lr_sens, scale_sensitivity_test=scale_test,
              width_sensitivity_test=width_test)


def test_claims_on_synthetic_results_with_nan_cells():
  analysis = {
      'a': {'sp': _stats(0.01, 0.5, 0.2, 0.3), 'bn': _stats(0.03, 0.4, 0.2, 0.3),
            'gmp': _stats(0.1, 0.1, 0.05, 0.01)},
      'b': {'sp': _stats(0.03, 0.1, NAN, 0.3), 'gmp': _stats(0.03, 0.2, 0.1, 0.3)},
      'c': {'sp': _stats(NAN), 'gmp': _stats(0.3)},
      'd': {'sp': _stats(0.01), 'wn': _stats(0.01)},  # no GmP: no claims
  }
  claims = rob.check_claims(analysis)
  assert not any(k.startswith('d:') for k in claims)
  verdict = lambda d, start: next(v for k, v in claims.items() if k.startswith(f'{d}: {start}'))
  assert verdict('a', "GmP's best").startswith('holds (GmP 0.1; sp 0.01, bn 0.03)')
  for what in ('GmP has the lowest', 'GmP has the test metric that varies least across init',
               'GmP has the test metric that varies least across widths'):
    assert verdict('a', what).startswith('holds'), what
  assert verdict('b', "GmP's best").startswith('does not hold')   # 0.03 < 3 x 0.03
  assert verdict('b', 'GmP has the lowest').startswith('does not hold')  # 0.2 > 0.1
  assert verdict('b', 'GmP has the test metric that varies least across init').startswith(
      'not measured')  # SP's NaN: no verdict even though 0.1 < NaN is False
  assert verdict('b', 'GmP has the test metric that varies least across widths').startswith(
      'does not hold')  # a tie is not "least"
  assert verdict('c', "GmP's best").startswith('not measured')  # SP never trained
  assert len(claims) == 12
  # GmP stuck at its initial error at every width varies by 0 but is not robust: no "holds".
  stuck = {'e': {'sp': _stats(0.01, width_test=0.3),
                 'gmp': dict(_stats(0.1, width_test=0.0), width_trained=False)}}
  verdict = next(v for k, v in rob.check_claims(stuck).items() if 'across widths' in k)
  assert verdict.startswith('does not hold') and 'did not train' in verdict, verdict


def _init(method, x, width=6):
  """`(scale, careless) -> (params, outputs)` of `method`'s MLP after `rescale`, jitted."""
  model = models.MLP(hidden=(width,), out=1, method=method, param_dtype=jnp.float64)

  @jax.jit
  def init(scale, careless):
    v = rob.rescale(model.init(jax.random.PRNGKey(3), x, train=False), method, scale, careless,
                    jax.random.PRNGKey(4))
    return v['params'], model.apply(v, x)
  return init


def test_init_scales_and_the_careless_init(x64):
  """Multipliers act on SP/BN's kernel, WN's g and GmP's r (the output layer untouched); the
  careless init gives SP, WN and GmP the same initial function (N(0, 1) weights), at fan-in 3
  (and GmP's fixed sign at fan-in 1)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (5, 3), jnp.float64)
  one, three, yes, no = jnp.float64(1.0), jnp.float64(3.0), jnp.bool_(True), jnp.bool_(False)
  outputs = {}
  for m, leaf in (('sp', ('hidden_0', 'kernel')), ('bn', ('hidden_0', 'kernel')),
                  ('wn', ('hidden_0_wn', 'hidden_0/kernel/scale')),
                  ('gmp', ('hidden_0', 'scale'))):
    init = _init(m, x)
    (base, _), (scaled, _) = init(one, no), init(three, no)
    np.testing.assert_allclose(scaled[leaf[0]][leaf[1]], 3.0 * base[leaf[0]][leaf[1]])
    np.testing.assert_array_equal(scaled['out']['kernel'], base['out']['kernel'])
    careless, outputs[m] = init(one, yes)
    if m == 'sp':
      assert 0.3 < float(jnp.std(careless['hidden_0']['kernel'])) < 3.0  # N(0, 1), not Glorot
  np.testing.assert_allclose(outputs['wn'], outputs['sp'], rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(outputs['gmp'], outputs['sp'], rtol=1e-10, atol=1e-12)
  x1 = x[:, :1]
  np.testing.assert_allclose(_init('gmp', x1)(one, yes)[1], _init('sp', x1)(one, yes)[1],
                             rtol=1e-10, atol=1e-12)


@needs_data
def test_the_grid_equals_its_cells_trained_alone(x64):
  """Two cells (different rate and init, careless included) of one fit call give what each
  gives trained alone (float64, GmP on Banana: minibatches shuffled per seed)."""
  c = ml_collections.ConfigDict(dict(depth=1, gmp_glorot_scale=False, seed=0, num_seeds=2,
                                     num_epochs=3, diverge_factor=2.0))
  data = banana_2d.make_data(*banana_2d.load_banana(DATA_DIR), 0, dtype=np.float64)
  cells = [(0.01, 3.0), (0.3, rob.CARELESS)]
  grid = rob.train_cells('banana', data, 'gmp', 5, cells, c, np.float64)
  for j, cell in enumerate(cells):
    alone = rob.train_cells('banana', data, 'gmp', 5, [cell], c, np.float64)
    for k in ('train_loss', 'train_loss_init', 'test', 'test_init'):
      np.testing.assert_allclose(grid[k][j], alone[k][0], rtol=1e-10, err_msg=f'{cell} {k}')
    np.testing.assert_array_equal(grid['epochs_run'][j], alone['epochs_run'][0])
  assert grid['train_loss'].shape == (2, 2)
  assert not np.allclose(grid['train_loss'][0], grid['train_loss'][1])  # cells differ
  assert not np.allclose(grid['train_loss'][0, 0], grid['train_loss'][0, 1])  # seeds differ


@needs_data
def test_a_tiny_run_through_main_writes_every_cell(tmp_path):
  workdir = tmp_path / 'rob'
  out = main.run_study('robustness', str(workdir), 'smoke', datasets='yacht',
                       data_dir=DATA_DIR,
                       learning_rates=(0.1, 3.0), init_scales=(1.0,), widths=(8,), hidden=8,
                       num_epochs=3)
  with open(workdir / 'results.json') as f:
    summary = json.load(f)
  # 2 methods x 2 rates x (1 scale + careless); one width (2 compiled fits: the extra widths'
  # fits are the same call, run by the smoke config).
  keys = {(x['dataset'], x['method'], x['width'], x['lr'], str(x['scale']))
          for x in summary['cells']}
  expected = {('yacht', m, w, lr, s) for m in ('sp', 'gmp') for lr in (0.1, 3.0)
              for w, s in ((8, '1.0'), (8, 'careless'))}
  assert keys == expected and len(summary['cells']) == 8
  for x in summary['cells']:
    assert {'train_loss', 'test_metric', 'test_metric_se', 'diverged'} <= set(x)
  with open(workdir / 'results.csv') as f:
    assert len(f.read().strip().splitlines()) == 1 + 8 * 2  # a row per seed
  assert set(summary['analysis']['yacht']) == {'sp', 'gmp'}
  assert any('lowest learning-rate sensitivity' in k for k in summary['claims'])
  for kind in ('lr', 'heatmap', 'width'):
    assert (workdir / f'{kind}_yacht.png').stat().st_size > 0
  assert out['summary']['metrics'] == {'yacht': 'rmse'}


def test_the_cifar10_cnn_through_main_writes_every_cell(tmp_path):
  """The CNN on a fake CIFAR-10 archive (3 classes, 8x8 images): every cell in results.json."""
  data_dir = tmp_path / 'data'
  fixtures.write_fake_jpeg_archive(str(data_dir), num_classes=3, train_per_class=6,
                                   test_per_class=2, size=8)
  workdir = tmp_path / 'rob'
  out = main.run_study('robustness', str(workdir), 'smoke', datasets='cifar10',
                       data_dir=str(data_dir), cache_dir=str(tmp_path / 'cache'),
                       methods='gmp_imn', learning_rates=(0.1, 3.0), init_scales=(1.0,),
                       cifar_width=2, cifar_widths=(2,), cifar_batch_size=6, cifar_epochs=2,
                       cifar_train_examples=0, cifar_test_examples=0, plots=False)
  with open(workdir / 'results.json') as f:
    summary = json.load(f)
  keys = {(x['dataset'], x['method'], x['width'], x['lr'], str(x['scale']))
          for x in summary['cells']}
  expected = {('cifar10', 'gmp_imn', 2, lr, s) for lr in (0.1, 3.0) for s in ('1.0', 'careless')}
  assert keys == expected and len(summary['cells']) == 4
  for x in summary['cells']:
    assert 0.0 <= x['test_metric'] <= 1.0 and 0.0 <= x['test_metric_init'] <= 1.0
    assert x['epochs_run'] == 2
  at = {(x['lr'], str(x['scale'])): x for x in summary['cells']}
  assert math.isfinite(at[(0.1, '1.0')]['train_loss'])
  # 3 classes: the initial cross-entropy of the default init (r = 1) is near ln 3.
  assert 0.5 < at[(0.1, '1.0')]['train_loss_init'] < 3.0
  # The careless N(0, 1) conv kernels (GmP: r = |w|) start from another function.
  assert at[(0.1, 'careless')]['train_loss_init'] != at[(0.1, '1.0')]['train_loss_init']
  with open(workdir / 'results.csv') as f:
    assert len(f.read().strip().splitlines()) == 1 + 4 * 2  # a row per seed
  assert out['summary']['metrics'] == {'cifar10': 'accuracy'}
  run = out['runs'][('cifar10', 'gmp_imn', 2)]
  assert run['train_loss'].shape == (4, 2)
  # `cifar_chunk_mb` vmaps the members in chunks (all 8 at once here): the same numbers as one
  # member at a time, up to float32 reassociation in the batched convolutions. Only what is stable
  # under reassociation is compared: every member's initial loss and accuracy, and the final ones
  # of the members at lr 0.1 (the grid is rate-major: rows 0-1). A member at lr 3.0 is chaotic:
  # on an AVX2-only host it ended at 3.04 alone and 6.4e7 chunked, its divergence flag flipped
  # (other hosts and ISAs give equal numbers). A wrong chunking (members mixed, a rate or a key taken from another member)
  # changes the initial values or the lr-0.1 members, so this still fails.
  chunked = main.run_study('robustness', str(tmp_path / 'rob_chunked'), 'smoke',
                           datasets='cifar10', data_dir=str(data_dir),
                           cache_dir=str(tmp_path / 'cache'), methods='gmp_imn',
                           learning_rates=(0.1, 3.0), init_scales=(1.0,), cifar_width=2,
                           cifar_widths=(2,), cifar_batch_size=6, cifar_epochs=2,
                           cifar_train_examples=0, cifar_test_examples=0, plots=False,
                           cifar_chunk_mb=1)['runs'][('cifar10', 'gmp_imn', 2)]
  assert rob.cnn_memory(2, 8, 6, 18, 3, (8, 8, 3), chunk_bytes=1 << 20)['chunk'] == 8
  for key in ('train_loss_init', 'test_init'):
    np.testing.assert_allclose(chunked[key], run[key], rtol=1e-4, atol=1e-6, err_msg=key)
  stable = [0, 1]
  assert [summary['cells'][j]['lr'] for j in stable] == [0.1, 0.1]
  assert not run['diverged'][stable].any()
  for key in ('train_loss', 'test', 'diverged'):
    np.testing.assert_allclose(chunked[key][stable], run[key][stable], rtol=1e-4, atol=1e-6,
                               err_msg=key)


BAD = [
  (dict(learning_rates=()), '--config.learning_rates=(): must be a tuple of finite numbers > 0'),
  (dict(learning_rates=(0.1, -1.0)), 'must be a tuple of finite numbers > 0'),
  (dict(learning_rates=(0.1, 0.1)), 'must be distinct finite numbers > 0'),
  (dict(init_scales=(0.3, 3.0)), 'must hold 1 (the default init'),
  (dict(init_scales=(0.0, 1.0)), 'must be a tuple of finite numbers > 0'),
  (dict(widths=()), '--config.widths=(): must be a tuple of ints >= 1'),
  (dict(widths=(0, 10)), 'must be a tuple of ints >= 1'),
  (dict(methods='sp,gmq'), "(did you mean 'gmp'?)"),
  (dict(datasets='levy,cifar10', cifar_widths=(4096,)),
   'the cifar10 CNN grid at width 4096 (6 members, batch 50, 400 images) needs about'),
  (dict(datasets='cifar10', cifar_train_examples=10), 'cifar_batch_size=50: more than the 10'),
  (dict(datasets='levy,yachtt'), "unknown datasets ['yachtt']"),
  (dict(datasets='levy,banana', data_dir='/nonexistent'), 'banana.csv not found'),
]


@pytest.mark.parametrize('fields, says', BAD, ids=[str(f) for f, _ in BAD])
def test_bad_settings_are_refused_before_any_work(tmp_path, fields, says):
  fields = {'data_dir': DATA_DIR, **fields}
  with pytest.raises(validate.ConfigError) as e:
    main.run_study('robustness', str(tmp_path / 'w'), 'smoke', **fields)
  assert says in str(e.value) and '\n' not in str(e.value), str(e.value)
  assert not (tmp_path / 'w').exists()


def test_the_command_line_exits_2_with_one_line_and_creates_nothing(tmp_path):
  proc = cli_fork.run_main(  # python -m experiments.main in a forked child (tests/cli_fork.py)
      ['--config=experiments/configs/robustness.py:smoke', f'--workdir={tmp_path / "w"}',
       '--config.datasets=levy,cifar10', '--config.cifar_widths=(4096,)'])
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().count('\n') == 0 and 'GiB' in proc.stderr, proc.stderr
  assert not (tmp_path / 'w').exists()


def test_the_cnn_whole_set_loss_mixes_the_class_sorted_rows():
  """The CIFAR arrays are sorted by class; the whole-set training-mode loss (BN, MBN and IMN use
  batch statistics) must use mixed batches like the epochs', never one-class runs of rows."""
  labels = np.repeat(np.arange(10), 100)  # the loader's order
  batches = np.asarray(rob.whole_set_batches(1000, 50))
  assert batches.shape == (20, 50) and len(set(batches.ravel().tolist())) == 1000
  assert min(len(set(labels[row].tolist())) for row in batches) >= 5
  assert np.array_equal(batches, np.asarray(rob.whole_set_batches(1000, 50)))  # fixed
