"""train_and_evaluate: one real training run on TFDS mock data, NaN handling, config errors."""

import json
import os

import numpy as np
import pytest

from conftest import mock_tfds
from experiments.vision import train
from experiments.configs import cifar10_cnn
from experiments.configs import imagenet32_vgg6
from tests import fixtures


def test_imagenet32_smoke_on_mock_tfds_records(tmp_path, capsys):
  config = imagenet32_vgg6.get_config('method=gmp_imn,smoke')
  assert config.learning_rate == 0.1 and config.method == 'gmp_imn'
  config.num_workers = 0
  with mock_tfds(64):
    summary = train.train_and_evaluate(config, str(tmp_path))
  assert summary['status'] == 'finished' and summary['steps'] == 64 // 16
  rows = [json.loads(l) for l in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert len(rows) == 1 and rows[0]['epoch'] == 1
  for k in ('train_loss', 'eval_loss', 'eval_top1', 'eval_top5'):
    assert np.isfinite(rows[0][k]), k
  assert 0.0 <= rows[0]['eval_top1'] <= rows[0]['eval_top5'] <= 1.0
  assert rows[0]['train_loss'] > 0 and abs(rows[0]['train_loss'] - np.log(1000)) < 3
  assert summary['state'].params['conv_0']['theta'].shape == (26, 8)
  assert os.path.exists(tmp_path / 'config.json') and os.path.exists(tmp_path / 'metrics.csv')
  assert os.path.isdir(tmp_path / 'checkpoints' / 'last')
  events = os.listdir(tmp_path / 'tensorboard')
  assert any(name.startswith('events.out.tfevents') for name in events), events
  out = capsys.readouterr().out
  assert 'img/s' in out and 'ETA' in out and '[train] wrote results.json, results.csv' in out
  results = json.loads((tmp_path / 'results.json').read_text())  # report.write, as every study
  assert results['status'] == 'finished' and results['last'] == summary['last']
  assert results['config']['method'] == 'gmp_imn' and (tmp_path / 'results.md').exists()


def test_nonfinite_loss_stops_with_message(tmp_path, monkeypatch):
  monkeypatch.setenv('GEOPARAM_CACHE_DIR', str(tmp_path / 'cache'))
  data = str(tmp_path / 'data')
  fixtures.write_fake_jpeg_archive(data, num_classes=3, train_per_class=8,
                                   test_per_class=2, size=8)
  config = cifar10_cnn.get_config('smoke')
  config.update(dict(layers=(4,), batch_size=8, eval_batch_size=6, learning_rate=1e30,
                     log_every=1, num_workers=0, data_dir=data))
  with pytest.raises(FloatingPointError, match='non-finite training loss'):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  failure = json.loads((tmp_path / 'run' / 'failure.json').read_text())
  assert failure['reason'] == 'nonfinite_loss' and failure['step'] >= 1
  events = [json.loads(l) for l in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  assert events[-1]['event'] == 'nonfinite_loss'
  # No checkpoint holds the bad state (none was finished before it).
  assert not os.listdir(tmp_path / 'run' / 'checkpoints' / 'last')


def test_locked_config_rejects_typos_and_bad_args():
  config = cifar10_cnn.get_config('smoke')
  config.lock()
  with pytest.raises(AttributeError):
    config.lerning_rate = 0.1
  with pytest.raises(ValueError, match='unknown config argument'):
    cifar10_cnn.get_config('smok')
  assert cifar10_cnn.get_config('method=gmp').learning_rate == 0.1
  assert cifar10_cnn.get_config('method=bn').learning_rate == 0.01


def test_missing_dataset_error_names_data_dir(tmp_path, monkeypatch):
  monkeypatch.delenv('GEOPARAM_DATA_DIR', raising=False)
  config = cifar10_cnn.get_config('smoke')
  config.data_dir = str(tmp_path / 'missing')
  with pytest.raises(FileNotFoundError, match='data_dir'):
    train.train_and_evaluate(config, str(tmp_path / 'run'))


def test_unknown_method_and_optimizer():
  config = cifar10_cnn.get_config('smoke')
  config.method = 'gmpp'
  with pytest.raises(ValueError, match='unknown methods'):
    train.create_model(config, 10)
  config = cifar10_cnn.get_config('smoke')
  config.optimizer = 'adagrad'
  with pytest.raises(ValueError, match="optimizer must be 'sgd' or 'adam'"):
    train.create_optimizer(config).init({'w': np.zeros(2)})
