"""UCI regression files: loading, random 80/20 splits and train-only standardization.

The format (shared/data/README.md): whitespace separated numbers (tabs or
spaces), any number of feature columns, the target in the last column, blank
lines ignored. `load('yacht')` reads `<data_dir>/uci/yacht.txt`, where
`data_dir` comes from the study's `--config.data_dir` or, when not given, the
environment variable `GEOPARAM_DATA_DIR` (the folder holding `uci/`). With
`download=True` (the study's `--config.download=True`) a file of the six paper datasets
missing there is fetched once from its public source into the cache
(`experiments.data.download`: checksum verified, `$GEOPARAM_CACHE_DIR` or
`~/.cache/geoparam`).

  from experiments.data import uci_data
  ds = uci_data.load('yacht', data_dir='../shared/data')   # ds.x (308, 6), ds.y (308,)
  split = uci_data.make_splits(len(ds.y), num_splits=10, seed=0, val_fraction=0.2)
  x_fit, x_val, x_test = uci_data.standardize(
      ds.x[split.fit[0]], ds.x[split.val[0]], ds.x[split.test[0]])
"""

from __future__ import annotations

import glob
import math
import os
from typing import NamedTuple

import numpy as np

from experiments.data import download as download_lib

__all__ = [
  'ENV_VAR',
  'PAPER_DATASETS',
  'DOWNLOADABLE',
  'Dataset',
  'Splits',
  'uci_dir',
  'available',
  'check_datasets',
  'parse',
  'load',
  'make_splits',
  'standardize',
]

ENV_VAR = 'GEOPARAM_DATA_DIR'
# The six benchmarks of paper 002, Table 3, in its column order.
PAPER_DATASETS = ('boston', 'concrete', 'energy', 'power', 'wine', 'yacht')
# Datasets that `download=True` can fetch.
DOWNLOADABLE = tuple(sorted(p[4:-4] for p in download_lib.REMOTES if p.startswith('uci/')))


def uci_dir(data_dir: str | None = None) -> str:
  """The folder holding the UCI `.txt` files: `<data_dir>/uci`, or `data_dir` itself if it has them.

  `data_dir` defaults to the environment variable `GEOPARAM_DATA_DIR`.
  """
  given = data_dir or os.environ.get(ENV_VAR)
  if not given:
    raise ValueError(
        f'no data directory: pass {download_lib.DATA_DIR_FLAG}=DIR or set {ENV_VAR}=DIR (the '
        'folder holding uci/).')
  candidates = [os.path.join(given, 'uci'), given]
  for path in candidates:
    if os.path.isdir(path) and glob.glob(os.path.join(path, '*.txt')):
      return path
  source = download_lib.DATA_DIR_FLAG if data_dir else ENV_VAR
  found = os.listdir(given) if os.path.isdir(given) else None
  raise ValueError(
      f'{source}={given!r}: no UCI .txt files in it or in its uci/ folder (expected one '
      f'<name>.txt per dataset, e.g. uci/{PAPER_DATASETS[-1]}.txt); '
      + ('that directory does not exist.' if found is None else 'that directory is empty.'
         if not found else f'that directory holds {_some(found, "entry", "entries")}.')
      + _download_hint(DOWNLOADABLE))


def _some(names, one: str = 'file', many: str = 'files', limit: int = 5) -> str:
  """A short listing for an error message: the count, then at most `limit` names.

  >>> _some(['b', 'a'])
  '2 files: a, b'
  >>> _some([f'f{i}.txt' for i in range(40)], limit=3)
  '40 files: f0.txt, f1.txt, f10.txt, ... (37 more)'
  """
  names = sorted(names)
  shown = ', '.join(names[:limit])
  more = f', ... ({len(names) - limit} more)' if len(names) > limit else ''
  return f'{len(names)} {one if len(names) == 1 else many}: {shown}{more}'


def _download_hint(names) -> str:
  """The sentence our errors end with for those of `names` that can be downloaded ('' if none)."""
  fetchable = [n for n in names if n in DOWNLOADABLE]
  if not fetchable:
    return ''
  one = len(fetchable) == 1
  return (f' Pass {download_lib.DOWNLOAD_FLAG} to fetch {", ".join(fetchable)} from '
          f'{"its public source" if one else "their public sources"}.')


def _local_dir(data_dir: str | None) -> str | None:
  """`uci_dir(data_dir)`, or None where that raises (no data directory, no .txt files)."""
  try:
    return uci_dir(data_dir)
  except ValueError:
    return None


def available(data_dir: str | None = None, download: bool = False) -> tuple[str, ...]:
  """Names of the datasets (`.txt` files without the suffix) in the UCI folder.

  With `download=True` also those that can be fetched (`DOWNLOADABLE`), and a missing data
  directory is no error.
  """
  folder = _local_dir(data_dir) if download else uci_dir(data_dir)
  local = {os.path.basename(p)[:-4] for p in glob.glob(os.path.join(folder, '*.txt'))
           } if folder else set()
  return tuple(sorted(local | set(DOWNLOADABLE if download else ())))


def check_datasets(names, data_dir: str | None = None, download: bool = False
                   ) -> tuple[str, ...]:
  """Returns the names as a tuple after checking that each can be read.

  Unknown names raise a ValueError listing (some of) the files found; a file of the data
  directory that `parse` refuses raises its one-line error (file and line), so a config check
  refuses a broken file before a run starts. Files still to be downloaded are not read here.
  """
  names = tuple(n.strip().lower() for n in names if n.strip())
  found = available(data_dir, download)
  unknown = [n for n in names if n not in found]
  if unknown or not names:
    where = (f'files in {uci_dir(data_dir)}' if not download
             else f'files in {_local_dir(data_dir)} or downloadable')
    raise ValueError(
        f'unknown datasets {unknown or list(names)}; valid ({where}): '
        f'{_join(found)}.' + ('' if download else _download_hint(unknown)))
  folder = _local_dir(data_dir)
  for name in names:
    path = os.path.join(folder, f'{name}.txt') if folder else None
    if path and os.path.isfile(path):
      parse(path)
  return names


def _join(names, limit: int = 10) -> str:
  """`names` comma separated, at most `limit` of them, then how many more."""
  names = list(names)
  more = f', ... ({len(names) - limit} more)' if len(names) > limit else ''
  return ', '.join(names[:limit]) + more


def parse(path: str) -> tuple[np.ndarray, np.ndarray, int]:
  """Reads one file: features `(n, d)`, targets `(n,)` (float64), last data row's line number.

  Errors name the file and the 1-based line number: a line that is not UTF-8 text, fewer
  than 2 columns, a non-numeric cell, or a row whose column count differs from the first row's.
  """
  rows, width, first_line, last_line = [], None, None, 0
  expected = 'a text file of whitespace-separated numbers, one row per line, the target last'
  for number, line in download_lib.text_lines(path, expected):
    cells = line.split()
    if not cells:
      continue
    if len(cells) < 2:
      raise ValueError(
          f'{path}, line {number}: {len(cells)} column; a UCI file needs at least 2 '
          '(features, then the target last).')
    if width is None:
      width, first_line = len(cells), number
    elif len(cells) != width:
      raise ValueError(
          f'{path}, line {number}: {len(cells)} columns, but line {first_line} has {width}.')
    try:
      rows.append([float(c) for c in cells])
    except ValueError:
      bad = next(c for c in cells if not download_lib.is_number(c))
      raise ValueError(f'{path}, line {number}: non-numeric cell {bad!r}.') from None
    last_line = number
  if not rows:
    raise ValueError(f'{path}: no data rows (only blank lines).')
  data = np.asarray(rows, np.float64)
  if not np.all(np.isfinite(data)):
    r, c = np.argwhere(~np.isfinite(data))[0]
    raise ValueError(
        f'{path}: non-finite value {data[r, c]} in column {c + 1} of data row {r + 1}.')
  return data[:, :-1], data[:, -1], last_line


class Dataset(NamedTuple):
  name: str
  x: np.ndarray  # (n, d) float64 features
  y: np.ndarray  # (n,) float64 targets
  path: str
  last_line: int  # line number of the last data row (for error messages)


def load(name: str, data_dir: str | None = None, download: bool = False,
         cache_dir: str | None = None, base_url: str | None = None) -> Dataset:
  """Features `(n, d)` and targets `(n,)` of `<uci dir>/<name>.txt`, float64.

  With `download=True` a file of `DOWNLOADABLE` missing from the data directory (or with no
  data directory at all) is fetched into the cache, or read from there when fetched before;
  `cache_dir` and `base_url` (a mirror laid out like the data directory) as in
  `experiments.data.download.fetch`.
  """
  folder = _local_dir(data_dir) if download else uci_dir(data_dir)
  path = os.path.join(folder, f'{name}.txt') if folder else None
  if path is None or not os.path.isfile(path):
    if download and name in DOWNLOADABLE:
      path = download_lib.find(f'uci/{name}.txt', data_dir, True, cache_dir, base_url)
    else:
      raise ValueError(
          f'--config.datasets: no file {name}.txt in {folder}; found: '
          f'{_join(available(data_dir, download))}.'
          + ('' if download else _download_hint([name])))
  x, y, last_line = parse(path)
  return Dataset(name, x, y, path, last_line)


class Splits(NamedTuple):
  """Row indices of `num_splits` random splits; each field has shape `(num_splits, part size)`."""
  fit: np.ndarray  # rows the model is trained on (and standardized with)
  val: np.ndarray  # validation rows carved from the training split (0 columns if none)
  test: np.ndarray  # held-out test rows


def split_sizes(n: int, test_fraction: float = 0.2, val_fraction: float = 0.0) -> tuple[int, ...]:
  """(fit, val, test) sizes; test and val rounded up as sklearn's `train_test_split` does."""
  n_test = math.ceil(test_fraction * n)
  n_val = math.ceil(val_fraction * (n - n_test))
  return n - n_test - n_val, n_val, n_test


def make_splits(n: int, num_splits: int, seed: int, test_fraction: float = 0.2,
                val_fraction: float = 0.0, source: str = 'the data') -> Splits:
  """Random splits of `n` rows; split `i` depends only on `(seed, i)`.

  With `val_fraction > 0` a validation part of that fraction is carved from the
  training part (the `clean` protocol). The fit part needs at least 2 rows (a
  standard deviation), the others at least 1.
  """
  if num_splits < 1:
    raise ValueError(f'--config.num_splits must be >= 1, got {num_splits}.')
  if not 0.0 < test_fraction < 1.0 or not 0.0 <= val_fraction < 1.0:
    raise ValueError(f'fractions must be in (0, 1), got test {test_fraction}, val {val_fraction}.')
  n_fit, n_val, n_test = split_sizes(n, test_fraction, val_fraction)
  if n_fit < 2 or n_test < 1 or (val_fraction > 0 and n_val < 1):
    raise ValueError(
        f'{source}: {n} rows is too few for a {1 - test_fraction:.0%}/{test_fraction:.0%} split'
        + (f' with a {val_fraction:.0%} validation part' if val_fraction else '')
        + f' (gives fit/val/test sizes {n_fit}/{n_val}/{n_test}; the fit part needs >= 2 rows).')
  perms = np.stack([np.random.default_rng([seed, i]).permutation(n) for i in range(num_splits)])
  return Splits(fit=np.sort(perms[:, :n_fit], axis=1),
                val=np.sort(perms[:, n_fit:n_fit + n_val], axis=1),
                test=np.sort(perms[:, n_fit + n_val:], axis=1))


def standardize(x_fit: np.ndarray, *others: np.ndarray) -> tuple[np.ndarray, ...]:
  """Standardizes every array with the mean and standard deviation of `x_fit` only.

  A constant column of `x_fit` (standard deviation 0) is centred and left
  unscaled, so it becomes 0 instead of NaN.
  """
  mean = x_fit.mean(axis=0)
  std = x_fit.std(axis=0)
  std = np.where(std > 1e-12 * np.maximum(1.0, np.abs(mean)), std, 1.0)
  return tuple((a - mean) / std for a in (x_fit, *others))
