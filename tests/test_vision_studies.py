"""Vision studies: one training epoch (a couple of steps) of each study config's smoke variant
through `train.train_and_evaluate`, on TFDS mock data or a tiny fake JPEG archive; config errors.
"""

import json

import numpy as np
import pytest

import geoparam
from benchmarks import vision_throughput
from conftest import mock_tfds
from experiments.vision import train
from experiments.vision import models as vision_models
from experiments.configs import cifar10_vgg6
from experiments.configs import cifar_lcw
from experiments.configs import imagenet_resnet50
from tests import fixtures


def _check_run(summary, workdir, steps, num_classes):
  assert summary['status'] == 'finished' and summary['steps'] == steps
  rows = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert len(rows) == 1
  for k in ('train_loss', 'eval_loss', 'eval_top1', 'eval_top5'):
    assert np.isfinite(rows[0][k]), k
  assert abs(rows[0]['train_loss'] - np.log(num_classes)) < 3
  return summary['state']


def test_imagenet_resnet50_smoke_on_mock_tfds_records(tmp_path):
  # BN (cheapest to compile); GmP+IMN through the same loop: test_train's ImageNet32 run, and
  # the ResNet's IMN running means: test_vision_models.
  config = imagenet_resnet50.get_config('method=bn,smoke')
  config.num_workers = 0
  with mock_tfds(16):
    summary = train.train_and_evaluate(config, str(tmp_path))
  state = _check_run(summary, tmp_path, 16 // 8, 1000)
  mean = np.asarray(state.batch_stats['stage0_block0']['conv2']['bn']['mean'])
  assert np.all(np.isfinite(mean)) and np.any(mean != 0)  # running statistics were updated
  assert state.params['stem']['conv']['kernel'].shape == (7, 7, 3, 4)


def test_cifar_lcw_smoke_on_mock_tfds_records(tmp_path):
  config = cifar_lcw.get_config('model=preact_resnet18,dataset=cifar10,smoke')
  assert (config.method, config.weight_decay, config.lr_schedule) == ('bn_lcw', 5e-4, 'decay')
  config.num_workers = 0
  with mock_tfds(16):
    summary = train.train_and_evaluate(config, str(tmp_path))
  state = _check_run(summary, tmp_path, 16 // 8, 10)
  kernel = geoparam.methods.lcw.kernel_from_v(
      np.asarray(state.params['stage0_block0']['conv2']['layer']['v']))
  np.testing.assert_allclose(np.sum(kernel, axis=0), 0.0, atol=1e-5)  # LCW after training


def test_cifar10_vgg6_smoke_on_a_fake_jpeg_archive(tmp_path, monkeypatch):
  monkeypatch.setenv('GEOPARAM_CACHE_DIR', str(tmp_path / 'cache'))
  data = str(tmp_path / 'data')
  fixtures.write_fake_jpeg_archive(data, num_classes=10, train_per_class=4,
                                   test_per_class=2, size=8)
  config = cifar10_vgg6.get_config('method=bn,smoke')
  config.update(dict(data_dir=data, num_workers=0, train_examples=0, eval_examples=0,
                     batch_size=20, eval_batch_size=20))
  summary = train.train_and_evaluate(config, str(tmp_path / 'run'))
  state = _check_run(summary, tmp_path / 'run', 2, 10)
  assert state.params['conv_5']['kernel'].shape == (3, 3, 32, 32)  # VGG-6 at width 1/16


def test_config_arguments_and_errors():
  c = cifar10_vgg6.get_config('method=gmp_imn')
  assert c.learning_rate == 0.1 and c.layers == (16, 16, 'M', 32, 32, 'M', 64, 64, 'M')
  assert cifar10_vgg6.get_config('method=wn_mbn').learning_rate == 0.01
  vgg19 = cifar_lcw.get_config('smoke')
  assert (vgg19.model, vgg19.method, vgg19.dropout_rate) == ('vgg19', 'bn_lcw', 0.0)
  assert cifar_lcw.get_config().dropout_rate == 0.5
  assert cifar10_vgg6.get_config('full,width=1').layers == tuple(
      vision_models.models.VGG6_LAYERS)
  r50 = imagenet_resnet50.get_config('method=wn_mbn')
  assert (r50.learning_rate, r50.batch_size, r50.augment, r50.image_size) == (
      0.1, 256, 'imagenet', 224)
  c100 = cifar_lcw.get_config('model=preact_resnet18,method=bn_cwn,dataset=cifar100')
  assert (c100.num_epochs, c100.dropout_rate, c100.min_lr) == (500, 0.0, 0.001)
  assert c100.decay_factor ** 5 == pytest.approx(0.95)
  with pytest.raises(ValueError, match="'lcw'.*accepted: sp, wn, wn_mbn, bn, gmp, gmp_imn"):
    imagenet_resnet50.get_config('method=lcw')
  with pytest.raises(ValueError, match="'gmp'.*accepted: sp, bn, lcw"):
    cifar_lcw.get_config('method=gmp')
  with pytest.raises(ValueError, match="model must be 'vgg19' or 'preact_resnet18'"):
    cifar_lcw.get_config('model=resnet50')
  with pytest.raises(ValueError, match="unknown dataset 'svhn'"):
    cifar_lcw.get_config('dataset=svhn')
  with pytest.raises(ValueError, match='unknown methods'):
    cifar10_vgg6.get_config('method=lcw')


def test_cifar_lcw_reduced_is_the_cpu_budget_with_the_papers_optimizer():
  full = cifar_lcw.get_config('model=preact_resnet18,method=bn')
  for model in ('vgg19', 'preact_resnet18'):
    r = cifar_lcw.get_config(f'model={model},method=lcw,reduced')
    assert (r.dataset, r.width, r.train_examples, r.eval_examples) == (
        'cifar10_jpeg', 0.125, 4000, 1000)
    assert r.num_epochs == cifar_lcw.NUM_EPOCHS_REDUCED < full.num_epochs
    assert r.stage_sizes == full.stage_sizes == (2, 2, 2, 2)
    for key in ('learning_rate', 'momentum', 'weight_decay', 'batch_size', 'decay_factor',
                'min_lr', 'lr_schedule', 'augment', 'optimizer'):
      assert r[key] == full[key], key
    assert r.dropout_rate == (0.5 if model == 'vgg19' else 0.0)
  assert full.decay_factor ** 3 == pytest.approx(0.95)
  with pytest.raises(ValueError, match='drop dataset=cifar100'):
    cifar_lcw.get_config('dataset=cifar100,reduced')


def test_throughput_benchmark_rejects_bad_arguments():
  with pytest.raises(ValueError, match="unknown models \\['vgg19'\\]; accepted: resnet50, vgg6"):
    vision_throughput.run(['vgg19'], tiny=True)
  with pytest.raises(ValueError, match='repeats must be >= 1'):
    vision_throughput.run(['vgg6'], tiny=True, repeats=0)
