"""CIFAR-10 as flat in-memory arrays: the data of the MLP studies (deep sigmoid, He init).

The archive is found and decoded (once, then cached) by
`experiments.vision.sources.load_jpeg_archive`: `cifar10-jpeg.tar.gz` or the
official `cifar-10-binary.tar.gz` in `data_dir` ($GEOPARAM_DATA_DIR), or with
`download=True` the official archive fetched into the cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.vision import sources


def load_flat_arrays(data_dir: str | None, train_examples: int = 0, test_examples: int = 0,
                     seed: int = 0, cache_dir: str | None = None, download: bool = False
                     ) -> dict[str, Any]:
  """CIFAR-10 as float32 `(n, 3072)` standardized images and int32 labels.

  Pixels scaled to [0, 1], standardized per channel (`sources.MEAN_STD['cifar']`),
  flattened. `train_examples`, `test_examples`: a fixed random subset drawn with `seed`,
  kept in archive order (0: all). Returns `x_train`, `y_train`, `x_test`, `y_test` and
  `num_classes`.

  The rows are SORTED BY CLASS (the archive's order): shuffle before taking the first rows
  or consecutive batches, or they hold one class (a training-mode BN loss and the epoch-0
  train curve were wrong that way until 2026-11-26).
  """
  data, classes = sources.load_jpeg_archive(data_dir, cache_dir, download=download)
  if 'test' not in data:
    raise ValueError(f'{sources.JPEG_ARCHIVE} has no test/ split; found {sorted(data)}.')
  mean, std = (np.asarray(v, np.float32) for v in sources.MEAN_STD['cifar'])
  out: dict[str, Any] = {'num_classes': len(classes)}
  rng = np.random.default_rng(seed)
  for split, n in (('train', train_examples), ('test', test_examples)):
    src = data[split]
    idx = np.arange(len(src))
    if n and n < len(src):
      idx = np.sort(rng.permutation(len(src))[:n])  # the archive is sorted by class
    images, labels = src.get(idx)
    x = (np.asarray(images, np.float32) / 255.0 - mean) / std
    out[f'x_{split}'] = x.reshape(len(idx), -1)
    out[f'y_{split}'] = np.asarray(labels, np.int32)
  return out
