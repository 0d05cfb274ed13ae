"""The Glorot-vs-He depth study (paper 001) on tiny generated data, and its errors."""

import json
import math

import jax
import numpy as np
import pytest

from experiments import he_init_depth as hid


def test_study_runs_end_to_end(tmp_path):
  workdir = tmp_path / 'out'
  lines = []
  hid.run_study(str(workdir), activations=['prelu'], train_examples=32, test_examples=16,
                depth=3, width=8, epochs=2, batch_size=16, log=lines.append)
  with open(workdir / 'results.json') as f:
    summary = json.load(f)
  runs = {'prelu_glorot', 'prelu_he'}
  assert set(summary['final_train_loss']) == runs
  for name in runs:
    assert np.isfinite(summary['final_train_loss'][name])
    assert len(summary['runs'][name]['curves']['test_acc']) == 3
    assert len(summary['runs'][name]['preactivation_std_at_init']) == 4  # 3 hidden + output
  assert len(summary['runs']['prelu_he']['prelu_mean_slope_per_layer']) == 3
  assert set(summary['claims']) == {'prelu: Glorot stalls and He trains'}
  assert (workdir / 'curves.png').stat().st_size > 0
  assert any('paper claim' in line for line in lines)


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


def test_bad_input(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match='valid activations: relu, prelu'):
    hid.run_study(str(tmp_path), activations=['tanh'])
  with pytest.raises(ValueError, match='valid inits: glorot, he'):
    hid.run_study(str(tmp_path), inits=['lecun'])
  with pytest.raises(ValueError, match='valid: synthetic, cifar10'):
    hid.run_study(str(tmp_path), data='mnist')
  monkeypatch.delenv('GEOPARAM_DATA_DIR', raising=False)
  with pytest.raises(FileNotFoundError, match='--data_dir'):
    hid.run_study(str(tmp_path), data='cifar10', data_dir=str(tmp_path / 'nowhere'))
