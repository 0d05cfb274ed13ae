"""Input pipelines: the JPEG-folder archive, per-process batches, augmentation, TFDS records."""

import io
import os

import ml_collections
import numpy as np
from PIL import Image
import pytest

from conftest import mock_tfds
from conftest import tfds_record
from experiments.vision import augmentation
from experiments.vision import loader as loader_lib
from experiments.vision import sources as sources_lib
from tests import fixtures


@pytest.fixture
def archive(tmp_path, monkeypatch):
  monkeypatch.setenv('GEOPARAM_CACHE_DIR', str(tmp_path / 'cache'))
  fixtures.write_fake_jpeg_archive(str(tmp_path / 'data'), num_classes=3, train_per_class=8,
                                   test_per_class=3, size=8)
  return str(tmp_path / 'data')


def _config(data_dir, **kw):
  c = ml_collections.ConfigDict(dict(
      dataset='cifar10_jpeg', data_dir=data_dir, cache_dir=None, train_examples=0,
      eval_examples=0, augment='flip'))
  c.update(kw)
  return c


def test_jpeg_archive_shapes_labels_and_cache(archive, monkeypatch):
  data, classes = sources_lib.load_jpeg_archive(archive)
  assert classes == ['class0', 'class1', 'class2']
  assert data['train'].images.shape == (24, 8, 8, 3) and data['train'].images.dtype == np.uint8
  assert data['test'].images.shape == (9, 8, 8, 3)
  for split in ('train', 'test'):
    src = data[split]
    # Class k was written around gray level 40 + 60k; JPEG keeps the mean within a few levels.
    means = src.images.reshape(len(src), -1).mean(1)
    np.testing.assert_allclose(means, 40 + 60 * src.labels, atol=6)
  # The second load reads the cache, never the archive.
  monkeypatch.setattr(sources_lib, 'decode_jpeg_archive', lambda *_: pytest.fail('decoded twice'))
  again, _ = sources_lib.load_jpeg_archive(archive)
  np.testing.assert_array_equal(again['train'].images, data['train'].images)


def test_missing_archive_names_data_dir(tmp_path, monkeypatch):
  monkeypatch.delenv('GEOPARAM_DATA_DIR', raising=False)
  with pytest.raises(FileNotFoundError, match='data_dir=.*GEOPARAM_DATA_DIR'):
    sources_lib.get_sources(_config(str(tmp_path / 'nowhere')))


def test_local_cifar10_finds_our_archive_first(archive, tmp_path):
  path, decode = sources_lib.local_cifar10(archive)
  assert path == os.path.join(archive, sources_lib.JPEG_ARCHIVE)
  assert decode is sources_lib.decode_jpeg_archive
  assert sources_lib.local_cifar10(str(tmp_path / 'nowhere')) is None
  assert sources_lib.local_cifar10(None) is None
  other = tmp_path / 'binary'
  other.mkdir()
  (other / sources_lib.CIFAR10_BINARY).write_bytes(b'')
  assert sources_lib.local_cifar10(str(other)) == (str(other / sources_lib.CIFAR10_BINARY),
                                                   sources_lib.decode_cifar10_binary)


def test_env_data_dir_is_used(archive, monkeypatch):
  monkeypatch.setenv('GEOPARAM_DATA_DIR', archive)
  sources = sources_lib.get_sources(_config(None))
  assert len(sources.train) == 24 and sources.num_classes == 3


def test_loader_deterministic_and_process_split_invariant(archive):
  src = sources_lib.get_sources(_config(archive)).train
  aug = augmentation.make_augment(_config(archive), train=True)
  one = loader_lib.Loader(src, 8, train=True, augment=aug, seed=3)
  assert one.steps_per_epoch == 3
  a = list(one.epoch(0))
  # grain worker processes (2) build the same batches in the same order.
  b = list(loader_lib.Loader(src, 8, train=True, augment=aug, seed=3, num_workers=2).epoch(0))
  assert len(a) == len(b) == 3
  for x, y in zip(a, b):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert a[0]['image'].shape == (8, 8, 8, 3) and a[0]['label'].dtype == np.int32
  # An epoch visits every example once (24 = 3 batches of 8).
  assert sorted(np.concatenate([x['label'] for x in a]).tolist()) == sorted(src.labels.tolist())
  # Other epochs shuffle differently.
  c = list(one.epoch(1))
  assert any((x['label'] != y['label']).any() for x, y in zip(a, c))
  # Two processes' halves of each batch assemble into the one-process batch.
  halves = [list(loader_lib.Loader(src, 8, train=True, augment=aug, seed=3, process_index=i,
                                   process_count=2).epoch(0)) for i in range(2)]
  for j, full in enumerate(a):
    for k in full:
      np.testing.assert_array_equal(
          np.concatenate([halves[0][j][k], halves[1][j][k]]), full[k])
  # Resuming mid-epoch yields the remaining batches unchanged.
  rest = list(one.epoch(0, start_step=1))
  np.testing.assert_array_equal(rest[0]['image'], a[1]['image'])
  # One iterator across epochs (the trainer's): epoch 0 from step 1, then epoch 1.
  across = list(one.iterate(0, 1, stop_epoch=2))
  assert len(across) == 5
  for x, y in zip(across, a[1:] + c):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_eval_loader_pads_and_masks(archive):
  src = sources_lib.get_sources(_config(archive)).eval
  loader = loader_lib.Loader(src, 4, train=False,
                             augment=augmentation.make_augment(_config(archive), False))
  batches = list(loader.epoch(0))
  assert len(batches) == 3  # 9 examples, batches of 4
  mask = np.concatenate([b['mask'] for b in batches])
  np.testing.assert_array_equal(mask, [1] * 9 + [0] * 3)
  np.testing.assert_array_equal(np.concatenate([b['label'] for b in batches])[:9], src.labels)


def test_batch_not_divisible_by_processes():
  src = sources_lib.ArraySource(np.zeros((10, 2, 2, 3), np.uint8), np.zeros(10, np.int32))
  with pytest.raises(ValueError, match='not divisible by the number of processes 3'):
    loader_lib.Loader(src, 4, train=True, augment=None, process_count=3)


def test_flip_and_crop_augmentations():
  x = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
  u = np.array([[0.1] + [0.0] * 7, [0.9] + [0.0] * 7], np.float32)
  y = augmentation.augment_flip(x, u)
  np.testing.assert_array_equal(y[0], x[0, :, ::-1])
  np.testing.assert_array_equal(y[1], x[1])
  z = augmentation.augment_flip(x, np.array([[0.9, 0.0, 0.0] + [0] * 5] * 2, np.float32),
                                pad_crop=1)
  np.testing.assert_array_equal(z[:, 1:, 1:], x[:, :3, :3])  # offset (0, 0) of the padding
  assert (z[:, 0] == 0).all()


def test_imagenet_augmentation_shapes():
  rng = np.random.default_rng(0)
  images = [rng.integers(0, 256, (30, 40, 3), dtype=np.uint8),
            rng.integers(0, 256, (50, 20), dtype=np.uint8)]
  u = rng.random((2, augmentation.NUM_UNIFORMS), dtype=np.float32)
  out = augmentation.augment_imagenet(images, u, crop=16, resize_range=(18, 30))
  assert out.shape == (2, 16, 16, 3) and out.dtype == np.uint8
  np.testing.assert_array_equal(
      out, augmentation.augment_imagenet(images, u, crop=16, resize_range=(18, 30)))
  ev = augmentation.center_crop_imagenet(images, crop=16, resize=18)
  assert ev.shape == (2, 16, 16, 3)


def test_tfds_source_reads_encoded_images_from_raw_records():
  with mock_tfds(12):
    sources = sources_lib.get_sources(_config(None, dataset='cifar10', eval_examples=6))
    assert sources.num_classes == 10 and len(sources.train) == 12 and len(sources.eval) == 6
    images, labels = sources.train.get([3, 0, 7])
    aug = augmentation.make_augment(_config(None), True)
    batches = list(loader_lib.Loader(sources.train, 4, train=True, augment=aug, seed=0).epoch(0))
    # The TFDS source is pickled to a grain worker process, which builds the same batches.
    in_worker = list(loader_lib.Loader(sources.train, 4, train=True, augment=aug, seed=0,
                                       num_workers=1).epoch(0))
  # The record's PNG comes out as bytes; a source of the same examples decoded (dicts, as TFDS
  # returns them without RAW_BYTES) gives the same pixels, labels and batches.
  assert all(isinstance(x, bytes) and x[:4] == b'\x89PNG' for x in images)
  assert labels.dtype == np.int32 and ((0 <= labels) & (labels < 10)).all()
  decoded = [{'image': np.asarray(Image.open(io.BytesIO(x))), 'label': y}
             for x, y in zip(*sources.train.get(range(12)))]
  as_arrays = sources_lib.TfdsSource(decoded)
  np.testing.assert_array_equal(as_arrays.get([3, 0, 7])[1], labels)
  for x, y in zip(as_arrays.get([3, 0, 7])[0], images):
    np.testing.assert_array_equal(x, np.asarray(Image.open(io.BytesIO(y))))
  reference = list(loader_lib.Loader(as_arrays, 4, train=True, augment=aug, seed=0).epoch(0))
  assert batches[0]['image'].shape == (4, 32, 32, 3) and batches[0]['image'].dtype == np.uint8
  assert len(batches) == len(in_worker) == len(reference) == 3
  for x, y, z in zip(batches, in_worker, reference):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
      np.testing.assert_array_equal(x[k], z[k])


def test_tfds_record_parsing_matches_the_stored_image_and_label():
  rng = np.random.default_rng(0)
  image = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
  encoded, label = sources_lib.TfdsSource([tfds_record(image, 42)]).get([0])
  np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(encoded[0]))), image)
  assert label.tolist() == [42]


def test_unknown_dataset():
  with pytest.raises(ValueError, match='unknown dataset'):
    sources_lib.get_sources(_config(None, dataset='mnist'))
