"""Data the tests share: a small fake CIFAR-10 JPEG archive (test fixtures, not library code)."""

import io
import os
import tarfile

import numpy as np

from experiments.vision import sources


def write_fake_jpeg_archive(directory: str, num_classes: int = 3, train_per_class: int = 8,
                            test_per_class: int = 4, size: int = 8, seed: int = 0) -> str:
  """Writes a small `cifar10-jpeg.tar.gz` of the real one's layout (tests, demos).

  Class `k` images are noise around the gray level `40 + 60 * k`, so labels can be
  checked after the lossy JPEG round trip. Returns the archive's path.
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  path = os.path.join(directory, sources.JPEG_ARCHIVE)
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
