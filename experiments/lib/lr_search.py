"""Learning-rate cross-validation, paper 002's protocol (Appendix C), shared by the small studies.

Paper 002: "we use cross-validation to select the learning rate for each
compared method from the set {0.001, 0.003, 0.01, 0.03, 0.1, 0.3}". A study
with `--config.lr_selection=cv` does, per method (and per UCI split):

1. `carve_folds`: K validation folds from the TRAINING indices only
   (deterministic from a seed; the test split is never an input);
2. `grid`: the members of the grid rates x folds x seeds (or splits), which the
   study trains in ONE `experiments.lib.protocol.fit` call
   (`learning_rate=lambda m: m['lr']`), each member on its fold's fit part,
   scored on its fold's held-out part (the fold takes the place of the test
   split; everything else follows the study's protocol);
3. `select`: every rate's score is the mean of its validation metric over the
   folds (and seeds); the best finite score wins;
4. the study retrains on the whole training part at the chosen rate and tests.

Rules of `select`: a rate with any non-finite fold value (diverged) has score
NaN and is never chosen; ties (equal means) go to the SMALLEST rate (the
conservative choice); when no rate has a finite score, the chosen rate is NaN
and `index` is -1 (reported as such, never a silent pick).

Folds: the training indices are permuted by `numpy.random.default_rng(seed)`;
the first `K * (n // K)` are cut into K equal folds, so every fold's fit part
has the same size and the folds train vmapped; the `n % K` leftover rows are in
every fit part and never validated.

  >>> folds = carve_folds(np.arange(10, 21), 3, seed=0)   # 11 training rows, 3 folds
  >>> folds.shape, fit_parts(np.arange(10, 21), folds).shape
  ((3, 3), (3, 8))
  >>> sorted(set(folds.ravel()) | set(np.arange(10, 21))) == list(range(10, 21))
  True
  >>> s = select([0.01, 0.1, 0.3], [[0.5, 0.7], [0.4, 0.4], [0.2, np.nan]])
  >>> s.rate, s.index, s.scores.tolist()
  (0.1, 1, [0.6, 0.4, nan])
  >>> select([0.01, 0.1], [[0.9], [0.9]], mode='max').rate   # a tie: the smaller rate
  0.01
  >>> select([0.01, 0.1], [[np.nan], [np.inf]]).index       # nothing finite
  -1
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from experiments.configs import validate
from experiments.lib import models

PAPER_GRID = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)  # paper 002, Appendix C: the default `lr_grid`
DEFAULT_FOLDS = 5
SELECTIONS = ('fixed', 'cv')


def _selection(v, config):
  validate.choice(SELECTIONS)(v, config)


def _grid(v, config):
  validate.distinct_positive_reals(v, config)
  if config.get('lr_selection', 'cv') == 'fixed' and tuple(v) != PAPER_GRID:
    raise validate.Bad('applies only with --config.lr_selection=cv (the fixed rates are '
                       'lr_gmp and lr_others)')


def _folds(v, config):
  validate.integer(2)(v, config)
  if config.get('lr_selection', 'cv') == 'fixed' and v != DEFAULT_FOLDS:
    raise validate.Bad('applies only with --config.lr_selection=cv')


# The three fields of a study that offers the search (merged into its CONFIG_RULES).
CONFIG_RULES = {'lr_selection': _selection, 'lr_grid': _grid, 'cv_folds': _folds}


def check_folds(num_folds: int, train_size: int, what: str, fit_least: int = 1) -> None:
  """Raises `validate.ConfigError` (one line) unless `num_folds` folds of `train_size` rows
  leave every fold >= 1 held-out row and a fit part of >= `fit_least` rows (`what` names the
  training set in the message)."""
  if num_folds > train_size:
    raise validate.ConfigError(
        f'--config.cv_folds={num_folds}: {what} has {train_size} training rows; at most '
        f'{train_size} folds leave every fold >= 1 held-out row.')
  if train_size - train_size // num_folds < fit_least:
    least = next((k for k in range(2, train_size + 1) if train_size - train_size // k >= fit_least),
                 None)
    fix = f'use at least {least} folds' if least else 'no fold count does'
    raise validate.ConfigError(
        f'--config.cv_folds={num_folds}: {what} has {train_size} training rows, so a fold\'s fit '
        f'part has {train_size - train_size // num_folds}, fewer than the {fit_least} it needs; '
        f'{fix}.')


def carve_folds(train_indices, num_folds: int, seed) -> np.ndarray:
  """Validation folds `(num_folds, n // num_folds)` of `train_indices` (`(n,)`), each sorted.

  Deterministic from `seed` (anything `numpy.random.default_rng` takes, e.g. `[seed, split]`);
  the folds are disjoint subsets of `train_indices`, the `n % num_folds` leftover rows in none.
  """
  train_indices = np.asarray(train_indices)
  n = train_indices.shape[0]
  if not 2 <= num_folds <= n:
    raise ValueError(f'cv_folds must be in [2, {n}] for {n} training rows, got {num_folds}.')
  size = n // num_folds
  order = np.random.default_rng(seed).permutation(n)[:num_folds * size]
  return np.sort(train_indices[order.reshape(num_folds, size)], axis=1)


def fit_parts(train_indices, folds) -> np.ndarray:
  """The fit part of every fold `(K, n - n // K)`: `train_indices` without the fold, sorted."""
  train_indices = np.asarray(train_indices)
  return np.stack([np.sort(np.setdiff1d(train_indices, f)) for f in np.asarray(folds)])


def positions(train_indices, rows) -> np.ndarray:
  """Positions of `rows` in `train_indices` (for arrays holding only the training rows)."""
  order = np.argsort(train_indices)
  return order[np.searchsorted(np.asarray(train_indices)[order], rows)]


def grid(num_rates: int, num_folds: int, num_seeds: int) -> dict[str, np.ndarray]:
  """The members of the grid, rate-major: `rate`, `fold`, `seed` index arrays of length
  `M = num_rates * num_folds * num_seeds`; an `(M,)` result reshapes to `(R, K, S)`."""
  r, k, s = np.meshgrid(np.arange(num_rates), np.arange(num_folds), np.arange(num_seeds),
                        indexing='ij')
  return dict(rate=r.ravel(), fold=k.ravel(), seed=s.ravel())


@dataclasses.dataclass(frozen=True)
class Selection:
  """The outcome of `select`: `rate` (NaN when nothing is finite), its `index` in the grid
  (-1 then), `scores` `(R,)` (mean over folds and seeds; NaN for a rate with a non-finite
  value) and `diverged` `(R,)` (a non-finite value in some fold or seed)."""
  rate: float
  index: int
  scores: np.ndarray
  diverged: np.ndarray


def select(rates: Sequence[float], values, mode: str = 'min') -> Selection:
  """Chooses the rate whose mean validation metric over `values[r]` (any shape) is best.

  `mode`: 'min' (RMSE, loss) or 'max' (accuracy). Ties -> the smallest rate; a rate with a
  non-finite value is never chosen; none finite -> rate NaN, index -1.
  """
  if mode not in ('min', 'max'):
    raise ValueError(f"mode must be 'min' or 'max', got {mode!r}.")
  rates = np.asarray(rates, np.float64)
  values = np.asarray(values, np.float64).reshape(len(rates), -1)
  diverged = ~np.all(np.isfinite(values), axis=1)
  scores = np.where(diverged, np.nan, np.mean(np.where(diverged[:, None], 0.0, values), axis=1))
  if np.all(diverged):
    return Selection(math.nan, -1, scores, diverged)
  best = np.nanmin(scores) if mode == 'min' else np.nanmax(scores)
  tied = np.flatnonzero(scores == best)
  index = int(tied[np.argmin(rates[tied])])
  return Selection(float(rates[index]), index, scores, diverged)


def search(fit_grid: Callable[[dict[str, np.ndarray]], np.ndarray], rates: Sequence[float],
           num_folds: int, num_seeds: int, mode: str, per_seed: bool = False) -> dict:
  """Runs the grid through `fit_grid` once and selects.

  Args:
    fit_grid: `members -> (M,) validation metric`; `members` is `grid(...)` plus `lr`
      (`(M,)` float64 rates): the study trains every member in one `protocol.fit` call.
    rates: the grid `(R,)`.
    num_folds, num_seeds: K and S (initialization seeds, or UCI splits).
    mode: 'min' or 'max' (see `select`).
    per_seed: one selection per seed (UCI: per split, over its K folds) instead of one
      over all K x S values.

  Returns:
    `values` `(R, K, S)`, `selections` (a list of S `Selection`s with `per_seed`, else one).
  """
  members = grid(len(rates), num_folds, num_seeds)
  members['lr'] = np.asarray(rates, np.float64)[members['rate']]
  values = np.asarray(fit_grid(members), np.float64).reshape(len(rates), num_folds, num_seeds)
  if per_seed:
    selections = [select(rates, values[:, :, s], mode) for s in range(num_seeds)]
  else:
    selections = [select(rates, values, mode)]
  return dict(values=values, selections=selections)


def distribution(chosen: Sequence[float]) -> dict[str, int]:
  """How often each rate was chosen, `{'0.01': 7, 'nan': 1}` (rates in increasing order)."""
  out: dict[str, int] = {}
  for r in sorted(chosen, key=lambda r: (math.isnan(r), r)):
    key = 'nan' if math.isnan(r) else f'{r:g}'
    out[key] = out.get(key, 0) + 1
  return out


def modal(chosen: Sequence[float]) -> float:
  """The rate chosen most often (ties: the smallest); NaN counts as a rate (so a NaN mode
  says most splits had no finite rate)."""
  counts = distribution(chosen)
  best = max(counts.values())
  key = next(k for k, v in counts.items() if v == best)
  return float(key)


# ---------------------------------------------------------------------------
# Reporting, shared by the studies that choose one rate per method (Levy, Banana).

PAPER_CLAIM = 'CV picks 0.1 for GmP and 0.01 for the others'


def paper_claim(chosen: dict[str, float]) -> str:
  """The verdict on paper 002's finding (Appendix C) for `chosen` (method -> rate): every GmP
  variant at 0.1, every other method at 0.01; no verdict when a rate is NaN."""
  from experiments.configs import common  # pylint: disable=g-import-not-at-top
  from experiments.lib import report  # pylint: disable=g-import-not-at-top
  holds = all(r == common.paper_lr(m) for m, r in chosen.items())
  return report.claim(holds, ', '.join(f'{m} {r:g}' for m, r in chosen.items()),
                      *chosen.values())


def summary(selections: dict[str, Selection], rates) -> dict[str, dict]:
  """results.json's view of one selection per method: `chosen_lr`, `val_score_by_lr`
  (NaN: diverged) and `diverged_by_lr`, each method -> ..."""
  keys = [f'{r:g}' for r in rates]
  return dict(chosen_lr={m: s.rate for m, s in selections.items()},
              val_score_by_lr={m: dict(zip(keys, s.scores.tolist()))
                               for m, s in selections.items()},
              diverged_by_lr={m: dict(zip(keys, s.diverged.tolist()))
                               for m, s in selections.items()})


def markdown(selections: dict[str, Selection], rates, metric: str, fixed: dict[str, tuple],
             chosen: dict[str, tuple], digits: int = 4) -> str:
  """Markdown table, one row per method: the chosen rate, every rate's validation score
  (`metric`, the chosen one bold, `diverged` for a rate with a non-finite fold), the test
  metric at the chosen rate and at the fixed rate (`(rate, values over seeds)` each)."""
  from experiments.lib import report  # pylint: disable=g-import-not-at-top
  rows = []
  for m, s in selections.items():
    cells = ['diverged' if d else report.bold(f'{v:.{digits}f}', i == s.index)
             for i, (v, d) in enumerate(zip(s.scores, s.diverged))]
    test = lambda pair: ('-' if not np.isfinite(pair[0]) else
                         f'{report.format_mean_se(pair[1], digits)} (lr {pair[0]:g})')
    rows.append([m, 'none finite' if s.index < 0 else f'{s.rate:g}', *cells, test(chosen[m]),
                 test(fixed[m])])
  return report.markdown_table(
      ['method', 'CV lr', *(f'val {metric} lr {r:g}' for r in rates),
       f'test {metric} at the CV lr', f'test {metric} at the fixed lr'], rows)


def metric_at_rates(selections: dict[str, Selection], cv_runs: dict[str, Any], fixed_runs,
                  fixed_rate: Callable[[str], float], value: Callable[[Any], Any], seeds: int
                  ) -> tuple[dict[str, tuple], dict[str, tuple]]:
  """`seed_report`'s `(fixed, chosen)`: method -> `(rate, per-seed test metric)` of the runs
  at the fixed rates (`fixed_runs`, at `fixed_rate(method)`) and at the CV-chosen rates
  (`cv_runs`; None where no rate had a finite score: NaN for every seed). `value`: a run's
  per-seed test metric.

  >>> none = select([0.1], [[np.nan]])                      # nothing finite: no run
  >>> fixed, chosen = metric_at_rates({'sp': none}, {'sp': None}, {'sp': {'rmse': [1.0, 2.0]}},
  ...                               lambda m: 0.01, lambda r: r['rmse'], seeds=2)
  >>> fixed['sp'], chosen['sp'][1].tolist()
  ((0.01, [1.0, 2.0]), [nan, nan])
  """
  chosen = {m: (s.rate, value(cv_runs[m]) if cv_runs[m] is not None else np.full(seeds, np.nan))
            for m, s in selections.items()}
  fixed = {m: (fixed_rate(m), value(r)) for m, r in fixed_runs.items()}
  return fixed, chosen


def seed_report(selections: dict[str, Selection], rates, *, folds: int, seeds: int, metric: str,
                key: str, mode: str, score: str, fixed: dict[str, tuple],
                chosen: dict[str, tuple]) -> tuple[dict, str, dict[str, str]]:
  """What a study whose seeds share one split (Levy, Banana) reports of its CV: results.json's
  `cv` entry, the markdown to append to its table and its two claims.

  `metric`: the test metric's name in text (`'RMSE'`); `key`: its results.json key
  (`'test_rmse'`); `mode`: `'min'` or `'max'` (better); `score`: how a rate was scored, in
  words; `fixed`, `chosen`: method -> `(rate, test metric per seed)` at the fixed and the CV
  rates (NaN values where no rate was finite).
  """
  from experiments.lib import report  # pylint: disable=g-import-not-at-top
  cv = dict(lr_grid=list(rates), cv_folds=folds, **summary(selections, rates), score=score,
            **{key: {m: report.mean_se(v)[0] for m, (_, v) in chosen.items()},
               f'{key}_se': {m: report.mean_se(v)[1] for m, (_, v) in chosen.items()}},
            per_seed={m: v for m, (_, v) in chosen.items()})
  table = ('\n\nLearning rate by cross-validation (paper 002, Appendix C): '
           f'{folds} folds of the training points x {seeds} seeds per rate, then all training '
           'points at the chosen rate (bold: the chosen score):\n\n'
           + markdown(selections, rates, metric, fixed, chosen))
  pick = max if mode == 'max' else min
  best = pick(chosen, key=lambda m: np.mean(chosen[m][1]))
  word = 'highest' if mode == 'max' else 'lowest'
  claims = {PAPER_CLAIM: paper_claim({m: s.rate for m, s in selections.items()}),
            f'GmP has the {word} test {metric} at the CV-chosen rates': report.claim(
                models.is_gmp(best), f'{word}{" mean" if mode == "max" else ""}: {best} '
                f'{np.mean(chosen[best][1]):.4f}', *(v for _, v in chosen.values()))}
  return cv, table, claims
