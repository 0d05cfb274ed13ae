"""The Glorot-vs-He depth study (paper 001): its smoke config through experiments.main on
generated data, the signal at init, and the settings it refuses."""

import json

import jax
import numpy as np
import pytest

from experiments.studies import he_init_depth as hid
from experiments import main
from experiments.configs import validate
from tests import cli_fork


def test_smoke_config_runs_through_main(tmp_path, capsys):
  workdir = tmp_path / 'out'
  main.run_study('he_init_depth', str(workdir), 'smoke', activations='prelu', depth=3, width=8,
                 batch_size=16, train_examples=32, test_examples=16)
  printed = capsys.readouterr().out
  with open(workdir / 'results.json') as f:
    summary = json.load(f)
  with open(workdir / 'config.json') as f:
    assert json.load(f)['study'] == 'he_init_depth'
  runs = {'prelu_glorot', 'prelu_he'}
  assert set(summary['final_train_loss']) == runs
  for name in runs:
    assert np.isfinite(summary['final_train_loss'][name])
    assert len(summary['runs'][name]['curves']['test_acc']) == 3  # init + 2 epochs
    assert summary['runs'][name]['curves']['lr'][1:] == [0.01, 0.01]  # constant
    assert len(summary['runs'][name]['preactivation_std_at_init']) == 4  # 3 hidden + output
  assert len(summary['runs']['prelu_he']['prelu_mean_slope_per_layer']) == 3
  assert set(summary['claims']) == {'prelu: Glorot stalls and He trains'}
  assert summary['data'] == {'num_train': 32, 'num_test': 16, 'num_classes': 10}
  for name in ('results.csv', 'results.md', 'curves.png'):
    assert (workdir / name).stat().st_size > 0, name
  assert 'paper claim' in printed and 'prelu_he epoch 2/2' in printed


def test_glorot_shrinks_the_signal_and_he_keeps_it():
  data = hid.make_synthetic(128, 8, seed=0)
  x = data['x_train']
  stds = {}
  for init in ('glorot', 'he'):
    model = hid.DeepRectifierMLP('relu', init, depth=8, width=128)
    params = model.init(jax.random.key(0), x)['params']
    stds[init] = hid.preactivation_std(model, {'params': params}, x)
  # Glorot with equal widths: variance x1/2 per ReLU layer (std x2^-1/2); He: preserved.
  ratio = stds['glorot'][7] / stds['glorot'][1]
  assert 0.5 * 2 ** -3 < ratio < 2 * 2 ** -3
  assert 0.5 < stds['he'][7] / stds['he'][1] < 2.0


def test_a_diverged_run_never_holds():
  """A NaN Glorot loss counts as stalling, but the claim gets no verdict."""
  he = dict(final_train_loss=0.4, final_test_acc=0.8)
  claims = hid.check_claims({'relu_glorot': dict(final_train_loss=float('nan'),
                                                 final_test_acc=0.1), 'relu_he': he}, 10)
  assert claims['relu: Glorot stalls and He trains'].startswith('not measured: a non-finite')
  claims = hid.check_claims({'relu_glorot': dict(final_train_loss=2.302, final_test_acc=0.1),
                             'relu_he': he}, 10)
  assert claims['relu: Glorot stalls and He trains'].startswith('holds (')


def test_bad_settings_are_refused_before_any_work(tmp_path, monkeypatch):
  cases = [
    (dict(activations='relu,tanh'), ('--config.activations=relu,tanh: must be distinct '
                                     'comma-separated names among relu, prelu')),
    (dict(inits='lecun'), ('--config.inits=lecun: must be distinct comma-separated names among '
                           'glorot, he')),
    (dict(dataset='mnist'), '--config.dataset=mnist: must be one of synthetic, cifar10.'),
    (dict(train_examples=0), '--config.train_examples=0: must be an int >= batch_size=128.'),
    (dict(test_examples=0), '--config.test_examples=0: must be an int >= 1.'),
    (dict(width=0), '--config.width=0: must be an int >= 1.'),
    (dict(weight_decay=-1.0), '--config.weight_decay=-1.0: must be a finite number >= 0.0.'),
    (dict(dataset='cifar10', data_dir=str(tmp_path / 'nowhere')),
     f'--config.data_dir={tmp_path / "nowhere"}: no cifar10-jpeg.tar.gz'),
  ]
  for fields, says in cases:
    with pytest.raises(validate.ConfigError) as e:
      main.run_study('he_init_depth', str(tmp_path / 'w'), **fields)
    assert says in str(e.value) and '\n' not in str(e.value), (fields, str(e.value))
  monkeypatch.delenv('GEOPARAM_DATA_DIR', raising=False)
  with pytest.raises(validate.ConfigError,
                     match='CIFAR-10 needs cifar10-jpeg.tar.gz .* no data directory is given'):
    main.run_study('he_init_depth', str(tmp_path / 'w'), 'cifar10')
  assert not (tmp_path / 'w').exists()
  with pytest.raises(ValueError, match='accepted: relu, prelu'):
    hid.DeepRectifierMLP('tanh').init(jax.random.key(0), np.zeros((1, 3), np.float32))


def test_a_bad_setting_exits_2_with_one_line(tmp_path):
  proc = cli_fork.run_main(  # python -m experiments.main in a forked child (tests/cli_fork.py)
      ['--config=experiments/configs/he_init_depth.py', f'--workdir={tmp_path / "w"}',
       '--config.inits=glorot,lecun'])
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().count('\n') == 0, proc.stderr
  assert 'names among glorot, he' in proc.stderr and proc.stdout == ''
  assert not (tmp_path / 'w').exists()
