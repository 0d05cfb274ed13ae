"""Input pipelines: random-access sources, per-process batches, augmentation, grain prefetch.

Sources (`get_sources(config)`):

- `cifar10_jpeg`: the offline CIFAR-10 archive `cifar10-jpeg.tar.gz`
  (`train/<class>/NNNN.jpg`, `test/<class>/NNNN.jpg`) in `config.data_dir` or
  `$GEOPARAM_DATA_DIR`. It is decoded once (classes in sorted order, files in
  sorted order) into a `.npz` cache outside the repository
  (`config.cache_dir`, `$GEOPARAM_CACHE_DIR` or `~/.cache/geoparam`). With
  `config.download=True` and no archive there, the official CIFAR-10 binary
  archive is fetched into the cache and decoded instead (`load_jpeg_archive`).
- `cifar10`, `cifar100`, `imagenet_resized/32x32`, `imagenet2012`: TFDS through
  `tfds.data_source` (ArrayRecord, random access, no TensorFlow needed), records read raw so
  that the images reach the transforms still encoded (`TfdsSource`).
  `tfds.load` would need TensorFlow for tf.data; random access also gives the
  exact, process-count independent data order below.

Order and sharding. Epoch `e` of the training set visits the examples in the
order `permutation(seed, e)`; global batch `b` is the slice `[b*B, (b+1)*B)` of
it and process `i` of `p` reads only its contiguous `B/p` part of every global
batch (the random-access equivalent of `tfds.even_splits`: each process reads
1/p of the data, and the assembled global batch is the same for any number of
processes, so a 2-host run equals a 1-host run). Augmentation randomness is
drawn per global batch from `(seed, epoch, b)`, so it is also independent of
the process count and of where a resumed run starts. The last partial training
batch is dropped; evaluation pads the last batch and gives padded examples
`mask = 0`.

Batches are numpy dicts `{'image': uint8 (b, h, w, 3), 'label': int32 (b,),
'mask': float32 (b,)}`; the train step normalizes images on the device. With
`augment='imagenet'` the host only decodes, crops (resizing just the crop) and flips; training
batches also carry `'colour': float32 (b, 4)`, the per-example uniforms of the colour jitter and
PCA lighting that the train step applies on the device (`colour_lighting`). Sources may return
encoded images (bytes) instead of arrays; the ImageNet transforms then decode them, at a
reduced JPEG scale where the resize allows. `image_folder` reads the user's own
`data_dir/train/<class>/*.jpg` and `val/` as encoded bytes; a file that cannot be decoded is
skipped (warned once, masked out, counted in the epoch's metrics), never a crash.

Batches are built by grain (`Loader`): `grain.MapDataset` maps a record index to a batch,
built on `num_threads` threads and `prefetch` batches ahead while the devices run (PIL and
numpy release the GIL), and with `num_workers > 0` in grain worker processes (`mp_prefetch`,
the order kept).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import tarfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

from absl import flags
from absl import logging
import numpy as np

from experiments.data import download as download_lib

JPEG_ARCHIVE = 'cifar10-jpeg.tar.gz'
CIFAR10_BINARY = 'cifar-10-binary.tar.gz'  # the official archive (experiments.data.download)
TFDS_DATASETS = {
  # name: (train split, eval split, num_classes)
  'cifar10': ('train', 'test', 10),
  'cifar100': ('train', 'test', 100),
  'imagenet_resized/32x32': ('train', 'validation', 1000),
  'imagenet2012': ('train', 'validation', 1000),
}
DATASETS = ('cifar10_jpeg', 'image_folder') + tuple(TFDS_DATASETS)

# Per-channel statistics of the uint8 images, used by the train step to normalize.
MEAN_STD = {
  'cifar': ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
  'imagenet': ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
# AlexNet-style PCA lighting noise (He et al. 2016 use it), RGB eigen-decomposition.
_EIGVAL = np.array([0.2175, 0.0188, 0.0045], np.float32)
_EIGVEC = np.array([[-0.5675, 0.7192, 0.4009],
                    [-0.5808, -0.0045, -0.8140],
                    [-0.5836, -0.6948, 0.4203]], np.float32)


# ---------------------------------------------------------------------------
# Sources: anything with len() and get(indices) -> (images list/array, labels).


@dataclasses.dataclass
class ArraySource:
  """In-memory images `(n, h, w, 3)` uint8 and labels `(n,)`."""

  images: np.ndarray
  labels: np.ndarray

  def __len__(self):
    return len(self.labels)

  def get(self, indices):
    return self.images[indices], self.labels[indices]


class TfdsSource:
  """A `tfds.data_source` split, random access. `get` returns each example's image as TFDS stored
  it, encoded (PNG/JPEG bytes: the transforms decode it, cropping before the resize), and its
  label. Records are read raw and parsed with TFDS's own `tf.train.Example` proto, so no
  TensorFlow is needed; a source of decoded examples (dicts) is read as arrays.
  """

  def __init__(self, source):
    self._source = source

  def __len__(self):
    return len(self._source)

  def get(self, indices):
    # Item by item: `__getitems__` is not implemented by every source.
    images, labels = zip(*(_image_and_label(self._source[int(i)]) for i in indices))
    return list(images), np.asarray(labels, np.int32)


def _image_and_label(record) -> tuple[Any, int]:
  """(image, label) of a TFDS record: a serialized `tf.train.Example` (the image's encoded bytes)
  or a decoded example (a uint8 array)."""
  if isinstance(record, dict):
    return np.asarray(record['image']), int(record['label'])
  from tensorflow_datasets.proto import tf_example_pb2  # pylint: disable=g-import-not-at-top

  feature = tf_example_pb2.Example.FromString(bytes(record)).features.feature
  return feature['image'].bytes_list.value[0], int(feature['label'].int64_list.value[0])


IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png')
EVAL_SPLITS = ('val', 'validation', 'test')  # an image folder's evaluation split, first found


class ImageFolderSource:
  """Encoded images of a folder `root/<class>/*.jpg|jpeg|png` (users' own data), random access.

  Classes are the sub-folders in sorted order (label = position); files are
  sorted within each class. `get` returns the files' bytes (the transforms
  decode them; a file that cannot be decoded is skipped by the loader, see
  `Loader`). Every problem a run could only meet later is an error here: a
  missing folder, no class folders, an empty class folder.
  """

  def __init__(self, root: str, classes: list[str] | None = None):
    if not os.path.isdir(root):
      raise FileNotFoundError(f'image folder {root!r} does not exist (expected '
                              f'{os.path.join(root, "<class>", "*.jpg")}).')
    found = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not found:
      raise ValueError(f'image folder {root!r} has no class folders (expected '
                       f'{os.path.join(root, "<class>", "*.jpg")}).')
    if classes is not None and found != list(classes):
      raise ValueError(f'image folder {root!r} has classes {found}, but the training split has '
                       f'{list(classes)}: every split needs the same class folders.')
    self.classes = found
    self.paths, labels = [], []
    for label, name in enumerate(found):
      folder = os.path.join(root, name)
      files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_SUFFIXES))
      if not files:
        raise ValueError(f'class folder {folder!r} holds no images '
                         f'({"/".join(IMAGE_SUFFIXES)}).')
      self.paths += [os.path.join(folder, f) for f in files]
      labels += [label] * len(files)
    self.labels = np.asarray(labels, np.int32)

  def __len__(self):
    return len(self.labels)

  def get(self, indices):
    images = []
    for i in indices:
      with open(self.paths[int(i)], 'rb') as f:
        images.append(f.read())
    return images, self.labels[np.asarray(indices, np.int64)]

  def describe(self, index: int) -> str:
    """The file of example `index` (named in the warning when it cannot be decoded)."""
    return self.paths[int(index)]


def image_folder_splits(root: str) -> tuple[ImageFolderSource, ImageFolderSource]:
  """`(train, eval)` of `root/train/<class>/*` and the first of `root/{val,validation,test}/`."""
  if not os.path.isdir(root):
    raise FileNotFoundError(f'image folder dataset {root!r} does not exist (data_dir; expected '
                            'train/<class>/*.jpg and val/<class>/*.jpg in it).')
  train_dir = os.path.join(root, 'train')
  if not os.path.isdir(train_dir):
    raise FileNotFoundError(f'image folder dataset {root!r}: no train/ split ({train_dir!r} is '
                            'missing); expected train/<class>/*.jpg and val/<class>/*.jpg.')
  eval_dir = next((os.path.join(root, s) for s in EVAL_SPLITS
                   if os.path.isdir(os.path.join(root, s))), None)
  if eval_dir is None:
    raise FileNotFoundError(f'image folder dataset {root!r}: no evaluation split (none of '
                            f'{", ".join(s + "/" for s in EVAL_SPLITS)} exists).')
  train = ImageFolderSource(train_dir)
  return train, ImageFolderSource(eval_dir, classes=train.classes)


def resolve_data_dir(data_dir: str | None) -> str | None:
  """`data_dir`, else `$GEOPARAM_DATA_DIR`, else None."""
  return data_dir or os.environ.get('GEOPARAM_DATA_DIR') or None


def default_cache_dir(cache_dir: str | None = None) -> str:
  return cache_dir or os.environ.get('GEOPARAM_CACHE_DIR') or os.path.join(
      os.path.expanduser('~'), '.cache', 'geoparam')


def decode_jpeg_archive(path: str) -> dict[str, tuple[np.ndarray, np.ndarray, list[str]]]:
  """Decodes `split/<class>/<file>.jpg` members: split -> (images, labels, class names).

  Classes are the sorted folder names of the `train` split; examples are in
  sorted (class, file name) order.
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top

  found: dict[str, list[tuple[str, str, np.ndarray]]] = {}
  with tarfile.open(path, 'r:*') as tf:
    for member in tf:
      if not member.isfile() or not member.name.lower().endswith(('.jpg', '.jpeg')):
        continue
      parts = member.name.strip('./').split('/')
      if len(parts) < 3:
        continue
      split, cls, fname = parts[-3], parts[-2], parts[-1]
      with Image.open(io.BytesIO(tf.extractfile(member).read())) as im:
        found.setdefault(split, []).append((cls, fname, np.asarray(im.convert('RGB'))))
  if 'train' not in found:
    raise ValueError(f'{path} has no train/<class>/*.jpg members; found splits {sorted(found)}.')
  classes = sorted({c for c, _, _ in found['train']})
  index = {c: i for i, c in enumerate(classes)}
  out = {}
  for split, items in found.items():
    items.sort(key=lambda t: (t[0], t[1]))
    unknown = sorted({c for c, _, _ in items} - set(index))
    if unknown:
      raise ValueError(f'{path}: split {split!r} has classes {unknown} not in train.')
    images = np.stack([a for _, _, a in items])
    labels = np.asarray([index[c] for c, _, _ in items], np.int32)
    out[split] = (images, labels, classes)
  return out


def decode_cifar10_binary(path: str) -> dict[str, tuple[np.ndarray, np.ndarray, list[str]]]:
  """Decodes the official CIFAR-10 binary archive (`cifar-10-binary.tar.gz`).

  Returns what `decode_jpeg_archive` returns: split -> (images `(n, 32, 32, 3)` uint8, labels
  `(n,)` int32, class names). Each record of `data_batch_{1..5}.bin` (train) and `test_batch.bin` (test) is one label byte
  and 3072 pixel bytes (1024 red, 1024 green, 1024 blue, rows of 32). Class names come from
  `batches.meta.txt`; labels are renumbered so that classes are in sorted order, as in the JPEG
  archive (CIFAR-10's own order already is).
  """
  record = 1 + 32 * 32 * 3
  parts: dict[str, list[tuple[str, np.ndarray]]] = {}
  names = None
  with tarfile.open(path, 'r:*') as tf:
    for member in tf:
      if not member.isfile():
        continue
      base = os.path.basename(member.name)
      split = ('train' if base.startswith('data_batch_') and base.endswith('.bin')
               else 'test' if base == 'test_batch.bin' else None)
      if base == 'batches.meta.txt':
        text = tf.extractfile(member).read().decode()
        names = [n.strip() for n in text.splitlines() if n.strip()]
      elif split:
        raw = np.frombuffer(tf.extractfile(member).read(), np.uint8)
        if raw.size % record:
          raise ValueError(f'{path}: {member.name} has {raw.size} bytes, not a multiple of the '
                           f'{record}-byte CIFAR-10 record.')
        parts.setdefault(split, []).append((base, raw.reshape(-1, record)))
  if 'train' not in parts or names is None:
    raise ValueError(f'{path} is not the CIFAR-10 binary archive: found splits {sorted(parts)}, '
                     f'batches.meta.txt {"present" if names else "missing"}.')
  classes = sorted(names)
  renumber = np.asarray([classes.index(n) for n in names], np.int32)
  out = {}
  for split, batches in parts.items():
    rows = np.concatenate([r for _, r in sorted(batches, key=lambda t: t[0])])
    if rows[:, 0].max() >= len(names):
      raise ValueError(f'{path}: label {rows[:, 0].max()} but only {len(names)} class names.')
    images = rows[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    out[split] = (np.ascontiguousarray(images), renumber[rows[:, 0]], classes)
  return out


def local_cifar10(data_dir: str | None) -> tuple[str, Callable] | None:
  """`(path, decoder)` of the CIFAR-10 archive in the folder `data_dir` (our JPEG archive, else
  the official binary one), or None when neither is there."""
  for name, decode in ((JPEG_ARCHIVE, decode_jpeg_archive),
                       (CIFAR10_BINARY, decode_cifar10_binary)):
    if data_dir and os.path.isfile(os.path.join(data_dir, name)):
      return os.path.join(data_dir, name), decode
  return None


def _find_cifar10(resolved: str | None, data_dir: str | None, cache_dir: str | None,
                  download: bool, base_url: str | None):
  """(archive path, decoder): the JPEG archive or the official binary one, local or fetched."""
  local = local_cifar10(resolved)
  if local is not None:
    return local
  if not download:
    raise FileNotFoundError(
        f'dataset cifar10_jpeg: {JPEG_ARCHIVE} not found in data_dir={resolved!r} '
        f'(config.data_dir={data_dir!r}, $GEOPARAM_DATA_DIR='
        f'{os.environ.get("GEOPARAM_DATA_DIR")!r}). Pass --config.data_dir=DIR or set '
        f'GEOPARAM_DATA_DIR to the folder holding {JPEG_ARCHIVE} (on these machines '
        f'../shared/data from the project root); the archive holds train/<class>/*.jpg and '
        f'test/<class>/*.jpg. Or allow the download (--config.download=True, download=True) of '
        f'the official CIFAR-10 archive ({CIFAR10_BINARY}, 170 MB) into the cache.')
  # A mirror of the data folder (base_url, $GEOPARAM_DATA_URL) serves our JPEG archive; the
  # public source is the official binary archive. Either one fetched before is reused.
  mirror = base_url or os.environ.get(download_lib.BASE_URL_ENV)
  cached_jpeg = os.path.join(download_lib.cache_root(cache_dir), JPEG_ARCHIVE)
  if mirror or os.path.isfile(cached_jpeg):
    return (download_lib.find(JPEG_ARCHIVE, resolved, True, cache_dir, base_url),
            decode_jpeg_archive)
  return (download_lib.find(CIFAR10_BINARY, resolved, True, cache_dir, base_url),
          decode_cifar10_binary)


def load_jpeg_archive(data_dir: str | None, cache_dir: str | None = None,
                      download: bool = False, base_url: str | None = None):
  """Loads (decoding once, then from the cache) the CIFAR-10 JPEG archive.

  Returns split -> ArraySource and the class names. The data directory may also hold the
  official binary archive `cifar-10-binary.tar.gz` instead. With `download=True` and neither
  there, the official archive is fetched into the cache (`experiments.data.download`; from the
  mirror `base_url` / `$GEOPARAM_DATA_URL` the JPEG archive is fetched instead).
  """
  resolved = resolve_data_dir(data_dir)
  path, decode = _find_cifar10(resolved, data_dir, cache_dir, download, base_url)
  st = os.stat(path)
  key = hashlib.sha1(f'{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}'.encode()).hexdigest()
  prefix = 'cifar10-jpeg' if decode is decode_jpeg_archive else 'cifar10-binary'
  cache = os.path.join(default_cache_dir(cache_dir), f'{prefix}-{key[:16]}.npz')
  if os.path.isfile(cache):
    with np.load(cache) as z:
      classes = [str(c) for c in z['classes']]
      splits = sorted({k.rsplit('_', 1)[0] for k in z.files if k != 'classes'})
      data = {s: ArraySource(z[f'{s}_images'], z[f'{s}_labels']) for s in splits}
    return data, classes
  decoded = decode(path)
  os.makedirs(os.path.dirname(cache), exist_ok=True)
  arrays = {'classes': np.asarray(decoded['train'][2])}
  for s, (images, labels, _) in decoded.items():
    arrays[f'{s}_images'] = images
    arrays[f'{s}_labels'] = labels
  tmp = f'{cache}.{os.getpid()}.tmp.npz'
  np.savez(tmp, **arrays)
  os.replace(tmp, cache)  # atomic: concurrent processes never read a partial file
  data = {s: ArraySource(v[0], v[1]) for s, v in decoded.items()}
  return data, list(decoded['train'][2])


def load_tfds(name: str, split: str, data_dir: str | None):
  """`tfds.data_source(name, split)` with an error that says how to prepare the data."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  data_dir = resolve_data_dir(data_dir)
  try:
    return TfdsSource(tfds.data_source(
        name, split=split, data_dir=data_dir, download=False,
        deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES))
  except Exception as e:  # tfds raises several types (DatasetNotFoundError, AssertionError, ...)
    manual = (' imagenet2012 needs the ILSVRC tars in <data_dir>/downloads/manual first.'
              if name == 'imagenet2012' else '')
    raise FileNotFoundError(
        f'dataset {name!r} split {split!r} not found in data_dir={data_dir!r} ({e}). Prepare it '
        f'as ArrayRecord where it can be downloaded: `tfds build {name} '
        f'--file_format=array_record --data_dir=DIR`, then pass --config.data_dir=DIR or set '
        f'GEOPARAM_DATA_DIR.{manual}') from e


@dataclasses.dataclass
class Sources:
  train: Any
  eval: Any
  num_classes: int
  mean_std: tuple[tuple[float, ...], tuple[float, ...]]


def get_sources(config) -> Sources:
  """The train and eval sources of `config.dataset`."""
  name = config.dataset
  if name == 'cifar10_jpeg':
    data, classes = load_jpeg_archive(config.data_dir, config.get('cache_dir'),
                                      config.get('download', False))
    if 'test' not in data:
      raise ValueError(f'{JPEG_ARCHIVE} has no test/ split; found {sorted(data)}.')
    train, test = data['train'], data['test']
    stats = MEAN_STD['cifar']
    num_classes = len(classes)
  elif name == 'image_folder':
    root = resolve_data_dir(config.data_dir)
    if not root:
      raise ValueError("dataset 'image_folder' needs config.data_dir (or $GEOPARAM_DATA_DIR): the "
                       'folder holding train/<class>/*.jpg and val/<class>/*.jpg.')
    train, test = image_folder_splits(root)
    stats = MEAN_STD['imagenet']
    num_classes = len(train.classes)
  elif name in TFDS_DATASETS:
    train_split, eval_split, num_classes = TFDS_DATASETS[name]
    train = load_tfds(name, train_split, config.data_dir)
    test = load_tfds(name, eval_split, config.data_dir)
    stats = MEAN_STD['cifar' if name.startswith('cifar') else 'imagenet']
  else:
    raise ValueError(f'unknown dataset {name!r}; accepted: {", ".join(DATASETS)}.')
  train = _subset(train, config.get('train_examples'))
  test = _subset(test, config.get('eval_examples'))
  return Sources(train=train, eval=test, num_classes=num_classes, mean_std=stats)


class _Subset:
  """Examples `keep` of `source`."""

  def __init__(self, source, keep):
    self.source, self.keep = source, np.asarray(keep, np.int64)

  def __len__(self):
    return len(self.keep)

  def get(self, indices):
    return self.source.get(self.keep[np.asarray(indices, np.int64)])

  def describe(self, index: int) -> str:
    return describe(self.source, int(self.keep[int(index)]))


def describe(source, index: int) -> str:
  """What example `index` of `source` is, for messages: its file where the source knows it."""
  return source.describe(index) if hasattr(source, 'describe') else f'example {index}'


def _subset(source, n):
  """`n` examples of `source` (None or 0: all): a fixed random subset of a source sorted by
  class (the archive, an image folder), the first `n` of a TFDS one."""
  if not n or n >= len(source):
    return source
  if not isinstance(source, (ArraySource, ImageFolderSource)):
    return _Subset(source, np.arange(n))
  # The archive and image folders are sorted by class: a fixed random subset has every class.
  keep = np.sort(np.random.default_rng(0).permutation(len(source))[:n])
  if isinstance(source, ArraySource):
    return ArraySource(source.images[keep], source.labels[keep])
  return _Subset(source, keep)


# ---------------------------------------------------------------------------
# Augmentation: functions of (images, per-example uniforms) -> uint8 batch.

NUM_UNIFORMS = 8


def augment_flip(images: np.ndarray, u: np.ndarray, pad_crop: int = 0) -> np.ndarray:
  """Random horizontal flips (u[:, 0] < 0.5), optionally after a random crop of a
  `pad_crop`-pixel zero padding (u[:, 1], u[:, 2] pick the offsets)."""
  images = np.asarray(images)
  out = images.copy()
  n, h, w = images.shape[:3]
  if pad_crop:
    padded = np.pad(images, ((0, 0), (pad_crop, pad_crop), (pad_crop, pad_crop), (0, 0)))
    oy = np.minimum((u[:, 1] * (2 * pad_crop + 1)).astype(int), 2 * pad_crop)
    ox = np.minimum((u[:, 2] * (2 * pad_crop + 1)).astype(int), 2 * pad_crop)
    for k in range(n):
      out[k] = padded[k, oy[k]:oy[k] + h, ox[k]:ox[k] + w]
  flip = u[:, 0] < 0.5
  out[flip] = out[flip, :, ::-1]
  return out


# What the train transform of `augment='imagenet'` leaves to the device (`colour_lighting`):
# brightness, contrast and saturation factors in [1 - COLOUR, 1 + COLOUR] and PCA lighting noise of
# scale LIGHTING, He et al. (2016) / AlexNet.
COLOUR, LIGHTING = 0.4, 0.1
DECODES_BYTES = True  # sources may return encoded images (bytes); the transforms decode them


def _open(item):
  """A source's image (encoded bytes, or an array `(h, w[, 1 or 3])` uint8) -> a PIL image.

  Encoded images are opened, not decoded: `_resized_crop` asks for a reduced JPEG decode first.
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top

  if isinstance(item, (bytes, bytearray, memoryview)):
    try:
      im = Image.open(io.BytesIO(item))
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, ...
      raise ValueError(f'cannot decode an encoded image of {len(item)} bytes: {e}') from e
    if im.mode not in ('RGB', 'L'):
      im = im.convert('RGB')
    return im
  img = np.asarray(item)
  if img.dtype != np.uint8 or not (img.ndim == 2 or (img.ndim == 3 and img.shape[-1] in (1, 3))):
    raise ValueError(f'expected a uint8 image (h, w), (h, w, 1) or (h, w, 3); got {img.dtype} '
                     f'{img.shape}.')
  return Image.fromarray(img.reshape(img.shape[:2]) if img.ndim == 3 and img.shape[-1] == 1
                         else img)


def _resized_crop(item, short: int, crop: int, uy: float | None, ux: float | None) -> np.ndarray:
  """The `crop` x `crop` window of `item` with its shorter side resized to `short`, `(crop, crop,
  3)` uint8.

  The window's offset in the resized image is `int(u * (size - crop + 1))` per axis (the centre
  for `u=None`), exactly where a resize of the whole image followed by a crop would take it; but
  only the window is computed: its box in the source's coordinates is resized to `crop` x `crop`
  (PIL bilinear with the same per-axis scale and the same sample positions, so the result is
  the resize-then-crop one up to PIL's edge handling). Encoded JPEGs are first decoded at the
  smallest power-of-2 reduction still at least as large as the resized image (`Image.draft`).
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top

  im = _open(item)
  w, h = im.size
  scale = short / min(h, w)
  nh, nw = max(short, round(h * scale)), max(short, round(w * scale))
  y = (nh - crop) // 2 if uy is None else min(int(uy * (nh - crop + 1)), nh - crop)
  x = (nw - crop) // 2 if ux is None else min(int(ux * (nw - crop + 1)), nw - crop)
  if getattr(im, 'format', None) == 'JPEG' and nw < w and nh < h:
    im.draft(im.mode, (nw, nh))  # decodes at 1/2, 1/4 or 1/8 where that stays >= (nw, nh)
  fx, fy = im.size[0] / nw, im.size[1] / nh
  box = (x * fx, y * fy, (x + crop) * fx, (y + crop) * fy)
  out = im.resize((crop, crop), Image.BILINEAR, box=box)
  if out.mode != 'RGB':
    out = out.convert('RGB')
  return np.asarray(out)


def _each(images, transform: Callable[[int, Any], np.ndarray], shape: tuple[int, ...] | None,
          errors: list | None) -> np.ndarray:
  """`transform(k, images[k])` for every image, stacked into a uint8 `(b, *shape)` batch.

  `shape` None: that of the first image transformed (`(1, 1, 3)` if none is). With a list
  `errors`, an ENCODED image that cannot be decoded (corrupt, truncated, not an image) is left
  as zeros and `errors[k]` gets the reason (the loader skips it); otherwise, and for arrays,
  the error is raised.
  """
  out = None if shape is None else np.zeros((len(images), *shape), np.uint8)
  if errors is not None:
    errors[:] = [None] * len(images)
  for k, img in enumerate(images):
    try:
      one = transform(k, img)
    except (OSError, ValueError, SyntaxError) as e:  # PIL: UnidentifiedImageError, truncated, ...
      if errors is None or not isinstance(img, (bytes, bytearray, memoryview)):
        raise
      errors[k] = f'{type(e).__name__}: {e}'
      continue
    if out is None:
      out = np.zeros((len(images), *np.shape(one)), np.uint8)
    out[k] = one
  return np.zeros((len(images), 1, 1, 3), np.uint8) if out is None else out


def augment_imagenet(images, u: np.ndarray, crop: int = 224,
                     resize_range: tuple[int, int] = (256, 480),
                     errors: list | None = None) -> np.ndarray:
  """He et al. (2016) training augmentation, host part: shorter side resized to a random size in
  `resize_range` (`u[:, 0]`), a random `crop` x `crop` crop (`u[:, 1:3]`), a random flip
  (`u[:, 3] < 0.5`). Only the crop is resized (`_resized_crop`).

  Args:
    images: `b` images, each encoded bytes or a uint8 array `(h, w[, 1 or 3])`.
    u: `(b, NUM_UNIFORMS)` uniforms in [0, 1); columns 4-7 drive `colour_lighting`.
    errors: see `_each` (undecodable encoded images recorded instead of raised).

  Returns:
    `(b, crop, crop, 3)` uint8. The colour jitter and lighting follow on the device
    (`colour_lighting`, in the train step).
  """
  if len(images) != len(u):
    raise ValueError(f'{len(images)} images but {len(u)} rows of uniforms.')

  def one(k, img):
    size = int(resize_range[0] + u[k, 0] * (resize_range[1] - resize_range[0] + 1))
    out = _resized_crop(img, min(max(size, crop), resize_range[1]), crop, u[k, 1], u[k, 2])
    return out[:, ::-1] if u[k, 3] < 0.5 else out

  return _each(images, one, (crop, crop, 3), errors)


def center_crop_imagenet(images, crop: int = 224, resize: int = 256,
                         errors: list | None = None) -> np.ndarray:
  """Evaluation: shorter side resized to `resize`, central `crop` x `crop` (only that window is
  computed, `_resized_crop`). `images`: encoded bytes or uint8 arrays; returns `(b, crop, crop,
  3)` uint8; `errors`: see `_each`."""
  return _each(images, lambda k, img: _resized_crop(img, max(resize, crop), crop, None, None),
               (crop, crop, 3), errors)


def colour_lighting(images, u, colour: float = COLOUR, lighting: float = LIGHTING):
  """Colour jitter and PCA lighting on the device, batched (jit-able; the train step calls it).

  Per example, with `f = 1 + colour * (2 u[:, 0:3] - 1)` (brightness, contrast, saturation
  factors): `x *= f_b`; `x = (x - m) f_c + m` with `m` the mean gray level (ITU-R 601 weights) of
  the image; `x = (x - g) f_s + g` with `g` the per-pixel gray; then the AlexNet PCA lighting
  offset `V (alpha * lambda)`, `alpha = lighting * r * (cos 2 pi u0, sin 2 pi u0, cos 2 pi u1)`,
  `r = sqrt(-2 log(max(1 - u3, 1e-7)))` (a Box-Muller radius); finally clipped to [0, 1].
  These are the formulas and distributions the host applied before (it also rounded to uint8).

  Args:
    images: `(b, h, w, 3)` uint8 (0..255) or float (already in [0, 1]).
    u: `(b, 4)` uniforms in [0, 1), columns 4-7 of the batch's `NUM_UNIFORMS`.
    colour, lighting: jitter and lighting strengths (0 disables).

  Returns:
    `(b, h, w, 3)` float32 in [0, 1].
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  x = jnp.asarray(images)
  x = x.astype(jnp.float32) / 255.0 if jnp.issubdtype(x.dtype, jnp.integer) else x.astype(
      jnp.float32)
  u = jnp.asarray(u, jnp.float32)
  # Weighted sums written out: a matmul would run at reduced precision on some accelerators.
  gray = lambda t: t[..., 0] * 0.299 + t[..., 1] * 0.587 + t[..., 2] * 0.114
  if colour:
    f = 1.0 + colour * (2.0 * u[:, :3] - 1.0)
    b, c, s = (f[:, i, None, None, None] for i in range(3))
    x = x * b
    m = jnp.mean(gray(x), axis=(1, 2))[:, None, None, None]
    x = (x - m) * c + m
    g = gray(x)[..., None]
    x = (x - g) * s + g
  if lighting:
    r = jnp.sqrt(-2.0 * jnp.log(jnp.maximum(1.0 - u[:, 3], 1e-7)))
    angle = 2.0 * jnp.pi * u
    alpha = lighting * r[:, None] * jnp.stack(
        [jnp.cos(angle[:, 0]), jnp.sin(angle[:, 0]), jnp.cos(angle[:, 1])], axis=-1)
    offset = jnp.sum(jnp.asarray(_EIGVEC)[None] * (alpha * jnp.asarray(_EIGVAL))[:, None, :],
                     axis=-1)
    x = x + offset[:, None, None, :]
  return jnp.clip(x, 0.0, 1.0)


def make_augment(config, train: bool) -> Callable[..., Any]:
  """The augmentation of `config.augment` ('none', 'flip', 'flip_crop' or 'imagenet'):
  `(images, uniforms (b, NUM_UNIFORMS), errors=None) -> uint8 batch` (or a dict of it and
  further per-example arrays); `errors` as in `_each`."""
  kind = config.augment
  if kind == 'imagenet':
    if train:
      # The batch carries the colour/lighting uniforms for the train step (`colour_lighting`).
      return lambda x, u, errors=None: {
          'image': augment_imagenet(x, u, crop=config.image_size,
                                    resize_range=tuple(config.resize_range), errors=errors),
          'colour': np.ascontiguousarray(u[:, 4:8], np.float32)}
    return lambda x, u, errors=None: center_crop_imagenet(
        x, crop=config.image_size, resize=config.eval_resize, errors=errors)
  if kind not in ('none', 'flip', 'flip_crop'):
    raise ValueError(f"augment must be 'none', 'flip', 'flip_crop' or 'imagenet', got {kind!r}.")

  def as_array(x, errors):
    if isinstance(x, list) and x and isinstance(x[0], (bytes, bytearray, memoryview)):
      x = _decode_same_size(x, errors)
    x = np.stack(x) if isinstance(x, list) else np.asarray(x)
    if x.ndim == 3 or x.shape[-1] == 1:  # grayscale -> RGB
      x = np.repeat(x.reshape(x.shape[:3] + (1,)), 3, axis=-1)
    return x

  if not train or kind == 'none':
    return lambda x, u, errors=None: as_array(x, errors)
  pad = 4 if kind == 'flip_crop' else 0
  return lambda x, u, errors=None: augment_flip(as_array(x, errors), u, pad_crop=pad)


class ImageSizeError(Exception):
  """Encoded images of different sizes where the augmentation does not resize them."""


def _decode_same_size(images, errors) -> np.ndarray:
  """Encoded images decoded to RGB `(b, h, w, 3)`, all of the first decodable image's size."""
  first = []  # the size of the first image decoded

  def decode(k, img):
    out = np.asarray(_open(img).convert('RGB'))
    if not first:
      first.append(out.shape)
    elif out.shape != first[0]:
      raise ImageSizeError(f"image {k} of the batch is {out.shape[:2]}, another {first[0][:2]}: "
                           "augment 'none'/'flip'/'flip_crop' do not resize; use augment="
                           "'imagenet' (resize and crop) for images of different sizes.")
    return out

  return _each(images, decode, None, errors)


# ---------------------------------------------------------------------------
# Batching.


class Loader:
  """Per-process batches of a random-access source, in a deterministic order, built by grain.

  Record `r` of the loader is this process's part of global batch `r % steps_per_epoch` of
  epoch `r // steps_per_epoch`, a pure function of `(seed, r)` (see the module docstring), so
  the batches are the same for any number of processes and workers, and a run resumes at any
  step by starting at its record. `grain.MapDataset` maps records to batches;
  `to_iter_dataset` builds them on `num_threads` threads and `prefetch` ahead, and with
  `num_workers > 0` grain's `mp_prefetch` runs that in worker processes (each its share of the
  records, the order kept).

  Args:
    source: has `len()` and `get(indices) -> (images, labels)` (picklable for worker processes).
    global_batch: examples per step over all processes.
    train: shuffle per epoch, drop the last partial batch, augment; else
      sequential order and a padded, masked last batch.
    augment: `(images, uniforms (b, NUM_UNIFORMS), errors=list) -> uint8 (b, h, w, 3)`, or a
      dict of it (`'image'`) and further per-example arrays that the batch carries too
      (`make_augment`). An encoded image it cannot decode (reported in `errors`) is skipped:
      warned once per process (naming its file), `mask = 0` in the batch, its slot filled with
      another image of the batch; `skipped` holds the indices met in this process.
    seed: data-order and augmentation seed.
    process_index, process_count: this process's part of each global batch.
    num_workers: grain worker processes building batches (0: none, threads of this process).
    num_threads: threads building batches in each process; prefetch: batches built ahead.
  """

  def __init__(self, source, global_batch: int, train: bool, augment, seed: int = 0,
               process_index: int = 0, process_count: int = 1, num_workers: int = 0,
               prefetch: int = 2, num_threads: int = 2):
    if global_batch % process_count:
      raise ValueError(
          f'global batch size {global_batch} is not divisible by the number of processes '
          f'{process_count}.')
    n = len(source)
    if train and n < global_batch:
      raise ValueError(f'the training set has {n} examples, fewer than one batch ({global_batch}).')
    if num_workers < 0 or num_threads < 1 or prefetch < 1:
      raise ValueError(f'need num_workers >= 0, num_threads >= 1 and prefetch >= 1; got '
                       f'{num_workers}, {num_threads}, {prefetch}.')
    self.source, self.global_batch, self.train, self.augment = source, global_batch, train, augment
    self.seed, self.process_index, self.process_count = seed, process_index, process_count
    self.local_batch = global_batch // process_count
    self.num_workers, self.num_threads, self.prefetch = num_workers, num_threads, prefetch
    self.steps_per_epoch = n // global_batch if train else -(-n // global_batch)
    self.skipped: set[int] = set()  # examples that could not be decoded (warned once each)
    self._lock = threading.Lock()
    self._orders: dict[int, np.ndarray] = {}

  def __getstate__(self):  # worker processes get a copy without the lock and the cached orders
    state = dict(self.__dict__)
    del state['_lock']
    state['_orders'] = {}
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def order(self, epoch: int) -> np.ndarray:
    n = len(self.source)
    if not self.train:
      return np.arange(n)
    return np.random.default_rng([self.seed, epoch]).permutation(n)

  def _batch(self, order: np.ndarray, epoch: int, b: int) -> dict[str, np.ndarray]:
    n = len(self.source)
    pos = b * self.global_batch + self.process_index * self.local_batch + np.arange(
        self.local_batch)
    mask = (pos < n).astype(np.float32)
    idx = order[np.minimum(pos, n - 1)]
    # One draw per global batch, sliced: independent of the process count.
    u = np.random.default_rng([self.seed, epoch, b, 1]).random(
        (self.global_batch, NUM_UNIFORMS), dtype=np.float32)
    u = u[self.process_index * self.local_batch:(self.process_index + 1) * self.local_batch]
    # Sorted reads are friendlier to record files; the result is put back in batch order.
    sort = np.argsort(idx, kind='stable')
    images, labels = self.source.get(idx[sort])
    inv = np.empty_like(sort)
    inv[sort] = np.arange(len(sort))
    images = [images[i] for i in inv] if isinstance(images, list) else np.asarray(images)[inv]
    labels = np.asarray(labels, np.int32)[inv]
    errors = []
    images = self.augment(images, u, errors=errors)
    extra = {}
    if isinstance(images, dict):  # the augmentation adds per-example inputs of the train step
      extra = {k: v for k, v in images.items() if k != 'image'}
      images = images['image']
    images = np.ascontiguousarray(images, np.uint8)
    bad = [k for k, e in enumerate(errors) if e]
    if bad:  # undecodable files: masked out, their slots hold a good image of the batch
      good = [k for k in range(len(images)) if not errors[k]]
      for k in bad:
        self._skip(int(idx[k]), errors[k])
        mask[k] = 0.0
        if good:  # so that batch statistics (BN, IMN) only see real images
          images[k] = images[good[0]]
    return {'image': images, 'label': labels, 'mask': mask, **extra}

  def _skip(self, index: int, error: str) -> None:
    """Warns once per example that cannot be decoded (naming its file where the source knows it)."""
    with self._lock:
      if index in self.skipped:
        return
      self.skipped.add(index)
    logging.warning('skipping an image that cannot be decoded: %s (%s); it is masked out of '
                    'every batch it is drawn in', describe(self.source, index), error)

  def batch_at(self, r: int) -> dict[str, np.ndarray]:
    """Record `r`: this process's part of batch `r % steps_per_epoch` of epoch
    `r // steps_per_epoch`."""
    epoch, b = divmod(int(r), self.steps_per_epoch)
    with self._lock:
      order = self._orders.get(epoch)
      if order is None:
        order = self._orders[epoch] = self.order(epoch)
        for old in [e for e in self._orders if e < epoch - 1]:
          del self._orders[old]
    return self._batch(order, epoch, b)

  def iterate(self, epoch: int = 0, start_step: int = 0,
              stop_epoch: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """This process's batches from step `start_step` of `epoch` through the end of epoch
    `stop_epoch - 1` (None: on and on), one grain iterator across epochs (its workers keep
    building the next epoch's batches while the caller evaluates)."""
    import grain.python as grain  # pylint: disable=g-import-not-at-top

    steps = self.steps_per_epoch
    start = epoch * steps + start_step
    stop = start + (1 << 62) if stop_epoch is None else stop_epoch * steps
    ds = grain.MapDataset.range(start, stop).map(self.batch_at).to_iter_dataset(
        grain.ReadOptions(num_threads=self.num_threads, prefetch_buffer_size=self.prefetch))
    if self.num_workers > 0:
      if not flags.FLAGS.is_parsed():  # grain's workers read its absl flags: their defaults
        flags.FLAGS.mark_as_parsed()
      ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.num_workers))
    return iter(ds)

  def epoch(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Yields this process's batches `start_step, ..., steps_per_epoch - 1` of `epoch`."""
    return self.iterate(epoch, start_step, epoch + 1)


def write_fake_jpeg_archive(directory: str, num_classes: int = 3, train_per_class: int = 8,
                            test_per_class: int = 4, size: int = 8, seed: int = 0) -> str:
  """Writes a small `cifar10-jpeg.tar.gz` of the real one's layout (tests, demos).

  Class `k` images are noise around the gray level `40 + 60 * k`, so labels can be
  checked after the lossy JPEG round trip. Returns the archive's path.
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  path = os.path.join(directory, JPEG_ARCHIVE)
  os.makedirs(directory, exist_ok=True)
  with tarfile.open(path, 'w:gz') as tf:
    for split, per_class in (('train', train_per_class), ('test', test_per_class)):
      for k in range(num_classes):
        for i in range(per_class):
          level = 40 + 60 * k
          img = np.clip(level + rng.integers(-10, 11, (size, size, 3)), 0, 255).astype(np.uint8)
          buf = io.BytesIO()
          Image.fromarray(img).save(buf, format='JPEG', quality=95)
          info = tarfile.TarInfo(f'{split}/class{k}/{i:04d}.jpg')
          info.size = buf.tell()
          buf.seek(0)
          tf.addfile(info, buf)
  return path
