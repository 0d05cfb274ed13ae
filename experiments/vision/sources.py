"""Where the vision trainer's images come from: random-access sources and the dataset tables.

A source is anything with `len()` and `get(indices) -> (images list/array, labels)`; images are
uint8 arrays or encoded bytes (the transforms of `experiments.vision.augmentation` decode them).
`get_sources(config)` gives the train and eval sources of `config.dataset`:

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
  exact, process-count independent data order of `experiments.vision.loader`.
- `image_folder`: the user's own `data_dir/train/<class>/*.jpg` and `val/`, read as encoded
  bytes (`ImageFolderSource`); a file that cannot be decoded is skipped by the loader.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import os
import tarfile
import zlib
from collections.abc import Callable
from typing import Any

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
  `experiments.vision.loader.Loader`). Every problem a run could only meet later is an error
  here: a missing folder, no class folders, an empty class folder.
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


def check_archive(path: str) -> None:
  """Raises ValueError naming `path` unless it reads to its end as a tar archive.

  A gzip archive is stream-read once to its end (its trailer's length and CRC checked: ~0.5 s
  for the 20 MB CIFAR-10 JPEG archive on a busy 2-core machine), so a truncated or corrupted
  download is refused before a run rather than in the decode, mid-run; the first member's
  header is read as tar.
  """
  gzipped = False
  try:
    with open(path, 'rb') as f:
      gzipped = f.read(2) == b'\x1f\x8b'
    if gzipped:
      with gzip.open(path, 'rb') as f:
        while f.read(1 << 22):
          pass
    with tarfile.open(path, 'r:*') as tf:
      tf.next()
  except (EOFError, OSError, zlib.error, tarfile.TarError) as e:
    reason = ('it ends before the end of its gzip stream' if isinstance(e, EOFError) else
              'not a tar archive' if isinstance(e, tarfile.ReadError) and not gzipped else
              f'{type(e).__name__}: {" ".join(str(e).split())}')
    raise ValueError(f'{path} is truncated or corrupt ({reason})') from None


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


def decoded_cache(path: str, decode: Callable, cache_dir: str | None = None) -> str:
  """The `.npz` that `load_jpeg_archive` decodes the archive `path` into (keyed by its absolute
  path, size and mtime: a changed archive is decoded again)."""
  st = os.stat(path)
  key = hashlib.sha1(f'{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}'.encode()).hexdigest()
  prefix = 'cifar10-jpeg' if decode is decode_jpeg_archive else 'cifar10-binary'
  return os.path.join(default_cache_dir(cache_dir), f'{prefix}-{key[:16]}.npz')


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
  cache = decoded_cache(path, decode, cache_dir)
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

