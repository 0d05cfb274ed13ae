"""The deep sigmoid MLP study (paper 003 Fig. 5) on a tiny fake CIFAR archive, and its errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import deep_sigmoid_mlp as dsm
from experiments import input_pipeline


@pytest.fixture(scope='module')
def fake_data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp('fake_cifar')
  input_pipeline.write_fake_jpeg_archive(str(d), num_classes=3, train_per_class=6,
                                         test_per_class=2, size=4)
  return d


def test_study_runs_end_to_end(fake_data_dir, tmp_path):
  workdir = tmp_path / 'out'
  lines = []
  methods = ('plain', 'lcw')
  out = dsm.run_study(str(workdir), methods, str(fake_data_dir), epochs=2, depth=2, width=8,
                      batch_size=6, cache_dir=str(tmp_path / 'cache'), log=lines.append)
  with open(workdir / 'results.json') as f:
    summary = json.load(f)
  assert set(summary['final_train_loss']) == set(methods)
  for m in methods:
    assert np.isfinite(summary['final_train_loss'][m]), m
    assert 0.0 <= summary['final_test_acc'][m] <= 1.0
    assert len(summary['curves'][m]['train_loss']) == 3  # init + 2 epochs
  # lr x0.95 per epoch from 0.1 (epoch 0 has no lr).
  np.testing.assert_allclose(summary['curves']['plain']['lr'][1:], [0.1, 0.095], rtol=1e-6)
  assert summary['config']['num_train'] == 18 and summary['config']['num_test'] == 6
  assert 'plain 50-layer sigmoid MLP stalls while LCW trains' in summary['claims']
  assert (workdir / 'curves.png').stat().st_size > 0
  assert any('paper claim' in line for line in lines)
  assert out['results']['lcw']['curves']['test_acc'][0] >= 0.0


@pytest.mark.parametrize('method', dsm.METHODS)
def test_every_method_builds_and_takes_a_train_step(method):
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


def test_unknown_method_lists_valid_ones(fake_data_dir, tmp_path):
  with pytest.raises(ValueError, match='valid methods: plain, lcw, bn, bn_lcw, wn, cwn, sn, sl'):
    dsm.run_study(str(tmp_path), ['plain', 'resnet'], str(fake_data_dir))
  with pytest.raises(ValueError, match='valid methods'):
    dsm.check_methods([])


def test_missing_data_dir_names_the_flag(tmp_path, monkeypatch):
  monkeypatch.delenv('GEOPARAM_DATA_DIR', raising=False)
  with pytest.raises(FileNotFoundError, match='--data_dir'):
    dsm.run_study(str(tmp_path / 'out'), ['plain'], str(tmp_path / 'nowhere'))
  with pytest.raises(FileNotFoundError, match='--data_dir'):
    dsm.run_study(str(tmp_path / 'out'), ['plain'], None)
  empty = tmp_path / 'empty'
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match='--data_dir'):
    dsm.run_study(str(tmp_path / 'out'), ['plain'], str(empty), cache_dir=str(tmp_path / 'c'))
