"""Image-folder datasets (`root/train/<class>/*.jpg`): the source, its errors, undecodable files."""

import io
import json
import logging
import os

import ml_collections
import numpy as np
import pytest
from PIL import Image

from experiments.vision import augmentation
from experiments.vision import loader as loader_lib
from experiments.vision import sources as sources_lib
from experiments.vision import train
from experiments.configs import cifar10_cnn
from experiments.configs import validate

CLASSES = ('cat', 'dog', 'eel')


def _jpeg(rng, h, w, level, fmt='JPEG') -> bytes:
  pixels = np.clip(rng.normal(level, 10, (h, w, 3)), 0, 255).astype(np.uint8)
  buf = io.BytesIO()
  Image.fromarray(pixels).save(buf, format=fmt)
  return buf.getvalue()


def make_folder(root, per_class=(4, 2), corrupt=(), size=(20, 26)):
  """train/ and val/ with `per_class` images of every class (class k near gray 40 + 80 k);
  `corrupt`: (split, class, name, bytes) files added as they are."""
  rng = np.random.default_rng(0)
  for split, n in zip(('train', 'val'), per_class):
    for k, c in enumerate(CLASSES):
      os.makedirs(os.path.join(root, split, c), exist_ok=True)
      for i in range(n):
        fmt, ext = ('PNG', 'png') if i == 1 else ('JPEG', 'jpg')
        with open(os.path.join(root, split, c, f'{i:03d}.{ext}'), 'wb') as f:
          f.write(_jpeg(rng, *size, 40 + 80 * k, fmt))
  for split, c, name, data in corrupt:
    with open(os.path.join(root, split, c, name), 'wb') as f:
      f.write(data)
  return str(root)


def _config(root, **kw):
  c = ml_collections.ConfigDict(dict(
      dataset='image_folder', data_dir=root, cache_dir=None, train_examples=0,
      eval_examples=0, augment='imagenet', image_size=8, resize_range=(10, 14), eval_resize=10))
  c.update(kw)
  return c


def test_source_lists_classes_files_and_labels(tmp_path):
  root = make_folder(tmp_path / 'data')
  sources = sources_lib.get_sources(_config(root))
  assert sources.num_classes == 3 and len(sources.train) == 12 and len(sources.eval) == 6
  assert sources.train.classes == list(CLASSES)
  np.testing.assert_array_equal(sources.train.labels, np.repeat([0, 1, 2], 4))
  images, labels = sources.train.get([5, 0])
  assert labels.tolist() == [1, 0] and isinstance(images[0], bytes)
  with open(os.path.join(root, 'train', 'dog', '001.png'), 'rb') as f:
    assert images[0] == f.read()
  assert sources.train.describe(5).endswith(os.path.join('train', 'dog', '001.png'))
  # A subset keeps every class (the folder is sorted by class) and names files correctly.
  sub = sources_lib.get_sources(_config(root, train_examples=6)).train
  _, labels = sub.get(np.arange(6))
  assert len(sub) == 6 and len(set(labels.tolist())) >= 2
  assert all(os.path.isfile(sub.describe(i)) for i in range(6))


def test_loader_decodes_and_crops_like_the_array_path(tmp_path):
  root = make_folder(tmp_path / 'data')
  sources = sources_lib.get_sources(_config(root))
  config = _config(root)
  batch = next(loader_lib.Loader(sources.eval, 6, train=False,
                                 augment=augmentation.make_augment(config, False)).epoch(0))
  encoded, _ = sources.eval.get(np.arange(6))
  np.testing.assert_array_equal(batch['image'],
                                augmentation.center_crop_imagenet(encoded, crop=8, resize=10))
  # Decoded arrays take the full-resolution path (no JPEG draft decode): close, not equal.
  arrays = [np.asarray(Image.open(p).convert('RGB')) for p in sources.eval.paths]
  diff = batch['image'].astype(int) - augmentation.center_crop_imagenet(arrays, crop=8, resize=10)
  assert np.abs(diff).max() <= 8 and abs(diff.mean()) < 1
  assert batch['mask'].tolist() == [1.0] * 6
  # Class k is near gray 40 + 80 k after decoding, crop and resize.
  np.testing.assert_allclose(batch['image'].mean(axis=(1, 2, 3)), 40 + 80 * batch['label'], atol=8)


def test_undecodable_files_are_skipped_with_one_warning_each(tmp_path, caplog):
  rng = np.random.default_rng(1)
  truncated = _jpeg(rng, 20, 26, 100)[:200]
  root = make_folder(tmp_path / 'data', corrupt=[
      ('train', 'dog', 'zz_garbage.jpg', b'not an image at all'),
      ('train', 'eel', 'zz_truncated.jpg', truncated),
      ('val', 'cat', 'zz_empty.png', b'')])
  config = _config(root)
  sources = sources_lib.get_sources(config)
  assert len(sources.train) == 14
  loader = loader_lib.Loader(sources.train, 7, train=True,
                             augment=augmentation.make_augment(config, True), seed=0,
                             num_workers=0)
  caplog.set_level(logging.WARNING)
  for epoch in range(2):
    batches = list(loader.epoch(epoch))
    order = loader.order(epoch)
    bad = {i for i, p in enumerate(sources.train.paths) if 'zz_' in p}
    for b, batch in enumerate(batches):
      idx = order[b * 7:(b + 1) * 7]
      expected = np.array([0.0 if i in bad else 1.0 for i in idx], np.float32)
      np.testing.assert_array_equal(batch['mask'], expected)
      good = batch['image'][expected == 1]
      for k in np.flatnonzero(expected == 0):  # the slot holds a real image of the batch
        assert any(np.array_equal(batch['image'][k], g) for g in good)
  assert loader.skipped == bad
  warnings = [r.getMessage() for r in caplog.records if 'cannot be decoded' in r.getMessage()]
  assert len(warnings) == 2  # once per file over both epochs
  assert any('zz_garbage.jpg' in w for w in warnings) and any('zz_truncated.jpg' in w
                                                               for w in warnings)
  # Without an errors list the transforms still raise (arrays and direct calls).
  with pytest.raises(ValueError, match='cannot decode'):
    augmentation.center_crop_imagenet([b'not an image'], crop=8, resize=10)


def test_flip_augment_decodes_same_size_images_and_refuses_mixed_sizes(tmp_path):
  root = make_folder(tmp_path / 'data', corrupt=[('train', 'cat', 'zz_bad.jpg', b'xx')])
  config = _config(root, augment='flip')
  sources = sources_lib.get_sources(config)
  aug = augmentation.make_augment(config, True)
  images, _ = sources.train.get(np.arange(len(sources.train)))
  errors = []
  out = aug(images, np.zeros((len(images), augmentation.NUM_UNIFORMS), np.float32) + 0.9,
            errors=errors)
  assert out.shape == (13, 20, 26, 3)
  assert [e is not None for e in errors] == ['zz_bad' in p for p in sources.train.paths]
  other = make_folder(tmp_path / 'mixed', size=(20, 26))
  with open(os.path.join(other, 'train', 'cat', 'zz_big.jpg'), 'wb') as f:
    f.write(_jpeg(np.random.default_rng(2), 30, 30, 50))
  images, _ = sources_lib.get_sources(_config(other, augment='flip')).train.get(np.arange(5))
  with pytest.raises(augmentation.ImageSizeError, match="use augment='imagenet'"):
    aug(images, np.zeros((5, augmentation.NUM_UNIFORMS), np.float32), errors=[])


@pytest.mark.parametrize('layout, match', [
    (lambda r: None, 'does not exist'),
    (lambda r: os.makedirs(r / 'val' / 'cat'), r'no train/ split'),
    (lambda r: os.makedirs(r / 'train' / 'cat'), 'no evaluation split'),
    (lambda r: (os.makedirs(r / 'train'), os.makedirs(r / 'val')), 'has no class folders'),
    (lambda r: (make_folder(r), os.makedirs(r / 'train' / 'fox')), r"class folder .*fox.* holds no"),
    (lambda r: (make_folder(r), os.makedirs(r / 'val' / 'fox')), 'every split needs the same'),
])
def test_bad_layouts_name_the_path(tmp_path, layout, match):
  root = tmp_path / 'data'
  if layout(root) is None and not root.exists():
    root = tmp_path / 'nowhere'
  with pytest.raises((FileNotFoundError, ValueError), match=match):
    sources_lib.get_sources(_config(str(root)))
  with pytest.raises(validate.ConfigError, match=match):  # the CLI's check before any work
    validate.check_vision_data(_config(str(root)))


def test_training_on_an_image_folder_counts_skipped_images(tmp_path, monkeypatch):
  root = make_folder(tmp_path / 'data', per_class=(4, 2), corrupt=[
      ('train', 'dog', 'zz_garbage.jpg', b'garbage'), ('val', 'eel', 'zz_bad.png', b'\x89PNG')])
  config = cifar10_cnn.get_config('smoke')
  config.update(dict(dataset='image_folder', data_dir=root, augment='imagenet', image_size=8,
                     resize_range=(10, 14), eval_resize=10, layers=(4,), batch_size=13,
                     eval_batch_size=7, num_epochs=2, log_every=1, num_workers=0))
  train.train_and_evaluate(config, str(tmp_path / 'run'))
  rows = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  epochs = [r for r in rows if 'event' not in r]
  assert len(epochs) == 2
  for r in epochs:  # 13 train images in one batch per epoch: the garbage file in each
    assert r['train_skipped'] == 1 and r['eval_skipped'] == 1
    assert np.isfinite(r['train_loss']) and 0.0 <= r['eval_top1'] <= 1.0
