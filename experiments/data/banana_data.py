"""The Banana data set (`banana.csv`): finding, parsing and checking the file (numpy only).

The format: a header line `At1,At2,Class`, then one row per point, two coordinates and the
class (-1 or 1), comma separated; blank lines are ignored. `parse(path)` reads a file and
raises a one-line `ValueError` naming the file and the line of the first problem (a ragged
row, a non-numeric cell, a class other than -1/1), so a config check can call it before a run
starts:

  from experiments.data import banana_data
  x, y = banana_data.load('../shared/data')   # x (5300, 2) float64, y (5300,) in {0, 1}
  banana_data.parse('/some/banana.csv')       # ValueError: /some/banana.csv, line 3: ...
"""

from __future__ import annotations

import os

import numpy as np

from experiments.data import download as download_lib

__all__ = ['FILE', 'HEADER', 'REFERENCE_POINTS', 'load', 'parse']

FILE = 'banana.csv'  # relative to the data directory
HEADER = ('At1', 'At2', 'Class')
# The points of the reference file (`download.REMOTES`' sha256): what a download gives.
REFERENCE_POINTS = 5300


def parse(path: str) -> tuple[np.ndarray, np.ndarray]:
  """`(x (N, 2) float64, y (N,) in {0, 1})` from a Banana CSV file.

  Raises:
    ValueError: one line naming the file and the 1-based line number: a line that is not
      UTF-8 text, a header other than At1,At2,Class, a row without 3 columns, a non-numeric or
      non-finite cell, a class other than -1 or 1, or no data rows.
  """
  rows = []
  expected = (f'a CSV text file: the header {",".join(HEADER)}, then rows of two numbers and '
              'a class -1 or 1')
  for number, line in download_lib.text_lines(path, expected):
    text = line.strip()
    if not text:
      continue
    cells = [c.strip() for c in text.split(',')]
    if number == 1:
      if tuple(cells) != HEADER:
        raise ValueError(f'{path}, line 1: header {text[:80]!r}, expected '
                         f'{",".join(HEADER)!r}.')
      continue
    if len(cells) != len(HEADER):
      raise ValueError(f'{path}, line {number}: {len(cells)} columns, expected '
                       f'{len(HEADER)} ({",".join(HEADER)}): {text[:80]!r}.')
    try:
      values = [float(c) for c in cells]
    except ValueError:
      bad = next(c for c in cells if not download_lib.is_number(c))
      raise ValueError(f'{path}, line {number}: non-numeric cell {bad[:40]!r}.') from None
    if not all(np.isfinite(values)):
      raise ValueError(f'{path}, line {number}: non-finite value in {text[:80]!r}.')
    if values[2] not in (-1.0, 1.0):
      raise ValueError(f'{path}, line {number}: class {cells[2]!r}, expected -1 or 1.')
    rows.append(values)
  if not rows:
    raise ValueError(f'{path}: no data rows after the header {",".join(HEADER)}.')
  table = np.asarray(rows, np.float64)
  return table[:, :2], (table[:, 2] > 0).astype(np.int64)


def load(data_dir: str | None = None, download: bool = False, cache_dir: str | None = None,
         base_url: str | None = None) -> tuple[np.ndarray, np.ndarray]:
  """`parse` of `banana.csv` in `data_dir` (else `$GEOPARAM_DATA_DIR`); with `download` the file
  is fetched into the cache when missing there (`experiments.data.download.find`)."""
  data_dir = data_dir or os.environ.get(download_lib.DATA_DIR_ENV)
  if not data_dir and not download:
    raise ValueError(
        f'no data directory: pass {download_lib.DATA_DIR_FLAG}=DIR (data_dir= in Python) or set '
        f'{download_lib.DATA_DIR_ENV}=DIR to the folder holding {FILE}, or allow the download '
        f'({download_lib.DOWNLOAD_FLAG}; download=True in Python).')
  path = download_lib.find(FILE, data_dir, download, cache_dir, base_url, error=ValueError)
  return parse(path)
