"""The deep sigmoid MLP study (paper 003 Fig. 5): its smoke config through experiments.main on a
tiny fake CIFAR archive, its model and init, and the settings it refuses."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.studies import deep_sigmoid_mlp as dsm
from experiments import main
from experiments.lib import models
from experiments.configs import validate
from tests import cli_fork
from tests import fixtures


@pytest.fixture(scope='module')
def fake_data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp('fake_cifar')
  fixtures.write_fake_jpeg_archive(str(d), num_classes=3, train_per_class=6,
                                   test_per_class=2, size=4)
  return d


def test_smoke_config_runs_through_main(fake_data_dir, tmp_path, capsys):
  workdir = tmp_path / 'out'
  out = main.run_study('deep_sigmoid_mlp', str(workdir), 'smoke', data_dir=str(fake_data_dir),
                       cache_dir=str(tmp_path / 'cache'), batch_size=6)
  printed = capsys.readouterr().out
  with open(workdir / 'results.json') as f:
    summary = json.load(f)
  with open(workdir / 'config.json') as f:
    assert json.load(f)['study'] == 'deep_sigmoid_mlp'
  methods = ('sp', 'lcw')
  assert set(summary['final_train_loss']) == set(methods)
  for m in methods:
    assert np.isfinite(summary['final_train_loss'][m]), m
    assert 0.0 <= summary['final_test_acc'][m] <= 1.0
    assert len(summary['curves'][m]['train_loss']) == 3  # init + 2 epochs
  # lr x0.95 per epoch from 0.1 (epoch 0 has no lr).
  np.testing.assert_allclose(summary['curves']['sp']['lr'][1:], [0.1, 0.095], rtol=1e-6)
  assert summary['data'] == {'num_train': 18, 'num_test': 6, 'num_classes': 3}
  assert summary['config']['depth'] == 3 and summary['data_dependent_init'] == ['sp', 'lcw']
  claim = 'SP 3-layer sigmoid MLP stalls while LCW trains'
  assert claim in summary['claims'] and f'paper claim: {claim}' in printed
  assert '| sp |' in printed and '| lcw |' in printed
  for name in ('results.csv', 'results.md', 'curves.png'):
    assert (workdir / name).stat().st_size > 0, name
  assert 'epoch 2/2' in printed  # the per-epoch progress lines
  assert out['results']['lcw']['curves']['test_acc'][0] >= 0.0


@pytest.mark.parametrize('method', dsm.METHODS)
def test_every_method_builds_and_takes_a_train_step(method):
  assert method in models.PARAMETERIZATIONS  # one vocabulary
  x = jax.random.normal(jax.random.key(1), (8, 6))
  y = jnp.arange(8) % 3
  model = dsm.DeepMLP(method, depth=2, width=5, num_classes=3)
  variables = dict(model.init(jax.random.key(0), x))  # eager; the jitted init is tested below
  params = variables.pop('params')

  def loss(p):
    logits, _ = model.apply({'params': p, **variables}, x, train=True, mutable=list(variables))
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(8), y])

  value, grads = jax.value_and_grad(loss)(params)
  assert np.isfinite(float(value))
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert model.apply({'params': params, **variables}, x, train=False).shape == (8, 3)


def test_data_dependent_init_gives_unit_preactivation_variance():
  x = jax.random.normal(jax.random.key(1), (64, 12))
  for method in ('wn',):  # WNDense is this study's own layer; LCW/CWN are tested in test_variance
    model = dsm.DeepMLP(method, depth=3, width=16, num_classes=4)
    variables = dsm.init_variables(model, jax.random.key(0), x)
    _, inter = model.apply(variables, x, capture_intermediates=True)
    z = inter['intermediates']['layer_1']['__call__'][0]
    np.testing.assert_allclose(float(jnp.var(z)), 1.0, rtol=1e-3, err_msg=method)


def test_a_diverged_run_never_holds():
  """stalled() counts a NaN loss as stalling; the claim must still not say 'holds'."""
  nan, ok = dict(final_train_loss=float('nan'), final_test_acc=0.1), dict(
      final_train_loss=1.5, final_test_acc=0.4)
  claims = dsm.check_claims({'sp': nan, 'lcw': ok, 'wn': nan}, 10, depth=50)
  assert set(claims) == {'SP 50-layer sigmoid MLP stalls while LCW trains',
                         'wn does not train at all (paper: omitted from Fig. 5)'}
  assert all(v.startswith('not measured: a non-finite result') for v in claims.values()), claims
  stalls = dict(final_train_loss=2.30, final_test_acc=0.1)
  claims = dsm.check_claims({'sp': stalls, 'lcw': ok}, 10, depth=50)
  assert claims['SP 50-layer sigmoid MLP stalls while LCW trains'].startswith('holds (')


def test_bad_settings_are_refused_before_any_work(fake_data_dir, tmp_path, monkeypatch):
  cases = [
    (dict(methods='sp,plain'), ('--config.methods=sp,plain: must be distinct comma-separated '
                                'names among sp, lcw, bn, bn_lcw, wn, cwn, sn, sl')),
    (dict(methods='sp,lcww'), "(did you mean 'lcw'?)"),
    (dict(methods='sp,gmp'), 'names among sp, lcw'),  # paper 002's ReLU methods are not here
    (dict(width=1), '--config.width=1: must be an int >= 2.'),
    (dict(depth=0), '--config.depth=0: must be an int >= 1.'),
    (dict(train_examples=100), ('--config.train_examples=100: must be an int >= '
                                'batch_size=128 or 0 (all).')),
    (dict(decay_factor=1.5), '--config.decay_factor=1.5: must be a finite number in (0.0, 1.0]'),
    (dict(learning_rate=float('nan')), '--config.learning_rate=nan: must be a finite number'),
    (dict(data_dir=str(tmp_path / 'nowhere')), (f'--config.data_dir={tmp_path / "nowhere"}: no '
                                                'cifar10-jpeg.tar.gz (or cifar-10-binary.tar.gz)')),
  ]
  for fields, says in cases:
    fields.setdefault('data_dir', str(fake_data_dir))
    with pytest.raises(validate.ConfigError) as e:
      main.run_study('deep_sigmoid_mlp', str(tmp_path / 'w'), **fields)
    assert says in str(e.value) and '\n' not in str(e.value), (fields, str(e.value))
  monkeypatch.delenv('GEOPARAM_DATA_DIR', raising=False)
  with pytest.raises(validate.ConfigError, match=r'no data directory is given \(no --config.data_dir, no \$GEOPARAM_DATA_DIR\); set'):
    main.run_study('deep_sigmoid_mlp', str(tmp_path / 'w'), 'smoke')
  assert not (tmp_path / 'w').exists()


def test_the_cli_refuses_an_old_method_name_with_one_line(tmp_path):
  """`python -m experiments.studies.deep_sigmoid_mlp` is experiments.main with this study's config."""
  proc = cli_fork.run_main(  # python -m experiments.main in a forked child (tests/cli_fork.py)
      ['--config=experiments/configs/deep_sigmoid_mlp.py', f'--workdir={tmp_path / "w"}',
       '--config.methods=plain,lcw'])
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().count('\n') == 0 and 'plain' in proc.stderr, proc.stderr
  assert 'names among sp, lcw' in proc.stderr and proc.stdout == ''
  assert not (tmp_path / 'w').exists()
