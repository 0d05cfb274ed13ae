"""One report for every study: results.json, results.csv, results.md and the claims block.

A study measures, then calls `write(workdir, study, ...)` once. The paper's
claims are stated with `claim`, which never says "holds" about a number that
is not finite (a diverged or NaN run):

  >>> claim(True, 'GmP RMSE {:.3f}', 0.8)
  'holds (GmP RMSE 0.800)'
  >>> claim(True, 'GmP RMSE {:.3f}', float('nan'))
  'not measured: a non-finite result (GmP RMSE nan)'
  >>> mean_se([1.0, 2.0, 3.0])
  (2.0, 0.5773502691896258)
  >>> format_values([1.0, 2.5]), bold(format_pair(0.8, 0.15, 2))
  ('1.000, 2.500', '**0.80 +- 0.15**')
  >>> collect({'sp': [1.0, 3.0], 'gmp': [0.5]}, best=min, n=len)
  {'best': {'sp': 1.0, 'gmp': 0.5}, 'n': {'sp': 2, 'gmp': 1}}
  >>> member_rows([({'method': 'sp'}, [1.0, 3.0])], 'seed', rmse=list, lr=lambda r: 0.1)
  [{'method': 'sp', 'seed': 0, 'rmse': 1.0, 'lr': 0.1},
   {'method': 'sp', 'seed': 1, 'rmse': 3.0, 'lr': 0.1}]
  >>> max_over_members([[1.0, 5.0, np.nan], [2.0, np.nan, np.nan]])
  array([ 2.,  5., nan])
  >>> print(markdown_table(['method', 'rmse'], [['sp', '1.14'], ['gmp', '0.80']]))
  | method | rmse |
  | --- | --- |
  | sp | 1.14 |
  | gmp | 0.80 |
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


def mean_se(values, single=None) -> tuple[float, float | None]:
  """Mean and standard error (ddof 1) of `values`; the error is `single` (None) for one value."""
  v = np.asarray(values, np.float64).ravel()
  if v.size == 0:
    raise ValueError('mean_se needs at least one value.')
  with np.errstate(invalid='ignore', over='ignore'):  # inf or NaN members (diverged): NaN s.e.
    se = float(np.std(v, ddof=1) / math.sqrt(v.size)) if v.size > 1 else single
    return float(np.mean(v)), se


def format_pair(mean: float, se: float | None, digits: int = 4) -> str:
  """'mean +- se' with `digits` decimals ('mean' alone when `se` is None)."""
  return f'{mean:.{digits}f}' + ('' if se is None else f' +- {se:.{digits}f}')


def format_mean_se(values, digits: int = 4) -> str:
  """'mean +- s.e.' of `values` ('mean' alone for one value)."""
  return format_pair(*mean_se(values), digits)


def format_values(values, spec: str = '.3f') -> str:
  """The per-member cell of a table: `values` formatted with `spec`, comma-separated."""
  return ', '.join(format(v, spec) for v in values)


def bold(text: str, flag: bool = True) -> str:
  """`**text**` (markdown bold) if `flag`, else `text`."""
  return f'**{text}**' if flag else text


def max_over_members(values) -> np.ndarray:
  """Per-step maximum over the members (axis 0) of `values`, ignoring NaN (a stopped member).

  Float64; NaN at the steps where every member is NaN (after all stopped).
  """
  v = np.asarray(values)
  out = np.full(v.shape[1:], np.nan)
  seen = np.any(np.isfinite(v), axis=0)
  out[seen] = np.nanmax(v[:, seen], axis=0)
  return out


def collect(runs: Mapping[Any, Any], depth: int = 1, **stats: Callable) -> dict[str, Any]:
  """`{name: {key: stat(run) for key, run in runs.items()} for name, stat in stats.items()}`.

  With `depth=2`, `runs` is a mapping of mappings of runs (e.g. rate -> method
  -> run) and each stat keeps both levels of keys.
  """
  def apply(stat, node, level):
    return {k: apply(stat, v, level - 1) if level > 1 else stat(v) for k, v in node.items()}
  return {name: apply(stat, runs, depth) for name, stat in stats.items()}


def member_rows(runs: Sequence[tuple[Mapping[str, Any], Any]], index: str,
                **columns: Callable) -> list[dict[str, Any]]:
  """Rows of results.csv, one per member (seed, split) of every run.

  `runs`: `(fields, run)` pairs; a row is `fields`, `{index: i}`, then every
  column: `column(run)[i]` (a per-member array) or `column(run)` (a scalar).
  The number of members is that of the first array column.
  """
  rows = []
  for fields, run in runs:
    values = {name: column(run) for name, column in columns.items()}
    n = next(len(v) for v in values.values() if np.ndim(v))
    rows += [{**fields, index: i, **{k: v[i] if np.ndim(v) else v for k, v in values.items()}}
             for i in range(n)]
  return rows


def finite(*measured) -> bool:
  """Whether every number in `measured` (scalars or arrays, nested lists) is finite."""
  return all(bool(np.all(np.isfinite(np.asarray(m, np.float64)))) for m in measured)


def claim(holds: bool, detail: str, *measured) -> str:
  """The verdict on one claim of a paper: 'holds (...)' or 'does not hold (...)'.

  `detail` is formatted with the scalars in `measured` (`detail.format(*measured)`
  when it has fields); every entry of `measured` (scalars or arrays) must be
  finite, else the verdict is 'not measured: a non-finite result (...)'.
  """
  text = detail.format(*measured) if '{' in detail else detail
  if not finite(*measured):
    return f'not measured: a non-finite result ({text})'
  return f'{"holds" if holds else "does not hold"} ({text})'


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A markdown table of `rows` (cells converted with str) under `header`."""
  lines = ['| ' + ' | '.join(header) + ' |', '|' + ' --- |' * len(header)]
  for row in rows:
    if len(row) != len(header):
      raise ValueError(f'row {row!r} has {len(row)} cells, the header {len(header)}.')
    lines.append('| ' + ' | '.join(str(c) for c in row) + ' |')
  return '\n'.join(lines)


def _jsonable(value):
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, np.generic):
    return value.item()
  return value


def write(workdir: str, study: str, *, summary: Mapping[str, Any],
          rows: Sequence[Mapping[str, Any]], table: str, claims: Mapping[str, str],
          config=None, started: float | None = None, figures: Sequence[str] = (),
          paper: Mapping[str, Any] | None = None, quiet: bool = False) -> dict[str, Any]:
  """Writes a study's results to `workdir` and prints its table and claims.

  Args:
    workdir: existing or new directory.
    study: the study's name, prefixing printed lines (`[levy_1d] ...`).
    summary: what results.json holds (arrays become lists); `claims`,
      `paper`, `config` and `wall_seconds` are added to it.
    rows: one dict per (method, seed, ...) run: results.csv, header from the
      first row's keys (every row must have the same keys).
    table: the markdown table of results.md (claims follow it as a list).
    claims: claim -> verdict (see `claim`).
    config: the study's ConfigDict (or dict), stored in results.json.
    started: `time.perf_counter()` at the study's start (wall time).
    figures: file names the study wrote (named in the last printed line).
    paper: the paper's numbers, stored next to ours in results.json.
    quiet: print nothing.

  Returns:
    The dict written to results.json.
  """
  os.makedirs(workdir, exist_ok=True)
  out = dict(summary)
  out['claims'] = dict(claims)
  if paper is not None:
    out['paper'] = paper
  if config is not None:
    out['config'] = config.to_dict() if hasattr(config, 'to_dict') else dict(config)
  if started is not None:
    out['wall_seconds'] = time.perf_counter() - started
  out = _jsonable(out)
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump(out, f, indent=2)
  if rows:
    header = list(rows[0])
    for r in rows:
      if list(r) != header:
        raise ValueError(f'results.csv rows must share the keys {header}, got {list(r)}.')
    with open(os.path.join(workdir, 'results.csv'), 'w', newline='') as f:
      writer = csv.writer(f)
      writer.writerow(header)
      writer.writerows([_jsonable(list(r.values())) for r in rows])
  claim_lines = [f'- {c}: {v}' for c, v in claims.items()]
  with open(os.path.join(workdir, 'results.md'), 'w') as f:
    f.write(table + '\n')
    if claim_lines:
      f.write('\nThe paper\'s claims against these results:\n\n' + '\n'.join(claim_lines) + '\n')
  if not quiet:
    print(table)
    for c, v in claims.items():
      print(f'[{study}] paper claim: {c}: {v}')
    files = ['results.json'] + (['results.csv'] if rows else []) + ['results.md', *figures]
    took = f' in {out["wall_seconds"]:.1f} s' if started is not None else ''
    print(f'[{study}] wrote {", ".join(files)} to {workdir}{took}', flush=True)
  return out
