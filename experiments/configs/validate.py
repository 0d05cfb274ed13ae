"""Checks a study config and its workdir before any work: one table of field rules.

`experiments.main` calls `check_config(config, study.CONFIG_RULES)` right after
reading the config (and the `--config.x=` overrides) and before it creates the
workdir; a bad setting raises `ConfigError` with a one-line message naming the
field, the value and what is accepted. Every field of every config needs a rule:
the study module's own `CONFIG_RULES` first (fields only it has, or its meaning of
a shared name), then the shared `RULES` here (exact name first, then the first
matching `fnmatch` pattern), so a new field cannot go unchecked. Nothing here
imports a study.

  >>> import ml_collections
  >>> c = ml_collections.ConfigDict(dict(learning_rate=0.1, num_epochs=0))
  >>> check_config(c)
  Traceback (most recent call last):
    ...
  experiments.configs.validate.ConfigError: --config.num_epochs=0: must be an int >= 1.
  >>> closest('num_epoch', ['num_epochs', 'seed'])
  'num_epochs'
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
import numbers
import glob
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

OPTIMIZERS = ('sgd', 'adam')
LR_SCHEDULES = ('plateau', 'decay', 'constant')
AUGMENTS = ('none', 'flip', 'flip_crop', 'imagenet')
MONITORS = ('eval_loss', 'eval_top1', 'eval_top5', 'train_loss', 'train_top1', 'train_top5')
MODES = ('min', 'max')


class ConfigError(ValueError):
  """A setting `experiments.main` refuses; `str(error)` is the one-line message."""


# ---------------------------------------------------------------------------
# Checks: `check(value, config) -> None`, raising `Bad(what is accepted)`.


class Bad(Exception):
  """Raised by a check: `str(error)` says what is accepted."""


def _is_int(v) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
  return isinstance(v, numbers.Real) and not isinstance(v, bool)


def integer(low: int, high: float = math.inf) -> Callable:
  """An int in `[low, high]`."""
  def check(v, config):
    del config
    if not (_is_int(v) and low <= v <= high):
      raise Bad(f'must be an int >= {low}' + (f' and <= {high}' if high < math.inf else ''))
  return check


def real(low: float, high: float = math.inf, *, open_low: bool = False,
         open_high: bool = False) -> Callable:
  """A finite real number in the interval `[low, high]` (ends open where asked)."""
  lo, hi = '(' if open_low else '[', ')' if open_high else ']'
  accepted = (f'a finite number in {lo}{low}, {high}{hi}' if high < math.inf else
              f'a finite number {">" if open_low else ">="} {low}')

  def check(v, config):
    del config
    ok = (_is_real(v) and math.isfinite(v) and (v > low if open_low else v >= low)
          and (v < high if open_high else v <= high))
    if not ok:
      raise Bad(f'must be {accepted}')
  return check


POSITIVE_REAL = real(0.0, open_low=True)  # learning rates, widths
FRACTION = real(0.0, 1.0, open_low=True, open_high=True)
COUNT = integer(0)  # patience, cooldown, example counts (0: all)
AT_LEAST_ONE = integer(1)  # epochs, batch sizes, widths in units


def boolean(v, config):
  del config
  if not isinstance(v, bool):
    raise Bad('must be True or False')


def optional_str(v, config):
  del config
  if v is not None and not isinstance(v, str):
    raise Bad('must be a string (a path) or None')


def choice(names: Sequence[str] | Callable[[Any], Sequence[str]]) -> Callable:
  """One of `names` (or of `names(config)` when the accepted names depend on other fields)."""
  def check(v, config):
    accepted = names(config) if callable(names) else names
    if v not in accepted:
      raise Bad(f'must be one of {", ".join(accepted)}' + _did_you_mean(v, accepted))
  return check


def split_names(v) -> tuple[str, ...]:
  """`'sp, gmp'` or `('sp', 'gmp')` -> `('sp', 'gmp')`."""
  items = v.split(',') if isinstance(v, str) else v if isinstance(v, (tuple, list)) else ()
  return tuple(str(m).strip() for m in items if str(m).strip())


def names_list(names: Sequence[str] | Callable[[], Sequence[str]]) -> Callable:
  """Distinct names from `names`, comma-separated (`--config.methods=sp,gmp`) or a tuple."""
  def check(v, config):
    del config
    accepted = names() if callable(names) else names
    items = split_names(v)
    bad = [m for m in items if m not in accepted]
    if not items or bad or len(set(items)) != len(items):
      hint = _did_you_mean(bad[0], accepted) if bad else ''
      raise Bad(f'must be distinct comma-separated names among {", ".join(accepted)}' + hint)
  return check


def distinct_names(v, config):
  """Distinct comma-separated names, e.g. UCI sets (which files exist: `check_data`)."""
  del config
  items = split_names(v)
  if not items or len(set(items)) != len(items):
    raise Bad('must be distinct comma-separated names')


def int_tuple(low: int, length: int | None = None) -> Callable:
  """A tuple of ints >= `low` (of `length` entries where given)."""
  def check(v, config):
    del config
    ok = (isinstance(v, (tuple, list)) and len(v) >= 1 and (length is None or len(v) == length)
          and all(_is_int(s) and s >= low for s in v))
    if not ok:
      n = f'{length} ' if length else ''
      raise Bad(f'must be a tuple of {n}ints >= {low}')
  return check


def positive_reals(v, config):
  """A non-empty tuple of finite numbers > 0: `--config.eps="(1e-3,1e-1)"`."""
  del config
  ok = isinstance(v, (tuple, list)) and len(v) >= 1 and all(
      _is_real(s) and math.isfinite(s) and s > 0 for s in v)
  if not ok:
    raise Bad('must be a tuple of finite numbers > 0, e.g. "(1e-3,1e-1)"')


def distinct_positive_reals(v, config):
  """A non-empty tuple of distinct finite numbers > 0 (a grid): `--config.x=0.01,0.1`."""
  positive_reals(v, config)
  if len(set(v)) != len(v):
    raise Bad('must be distinct finite numbers > 0, e.g. "(1e-3,1e-1)"')


def resize_range(v, config):
  int_tuple(1, 2)(v, config)
  if v[0] > v[1]:
    raise Bad('must be (low, high) with low <= high')


def mesh_shape(v, config):
  del config
  ok = (isinstance(v, (tuple, list)) and len(v) in (1, 2) and
        all(_is_int(s) and (s == -1 or s >= 1) for s in v) and list(v).count(-1) <= 1)
  if not ok:
    raise Bad('must be (data,) or (data, model), entries >= 1 and at most one -1')


def layer_spec(v, config):
  """Conv widths (ints >= 1) and 'M' (2x2 max pool): `--config.layers="(16,'M',32)"`."""
  del config
  ok = isinstance(v, (tuple, list)) and any(_is_int(s) for s in v) and all(
      (_is_int(s) and s >= 1) or s == 'M' for s in v)
  if not ok:
    raise Bad("must be a tuple of conv widths (ints >= 1) and 'M' (max pool), with at least "
               "one width, e.g. \"(16,'M',32)\"")


def str_tuple(v, config):
  del config
  if not (isinstance(v, (tuple, list)) and all(isinstance(s, str) and s for s in v)):
    raise Bad('must be a tuple of names')


def mlp_examples(train: bool) -> Callable:
  """Example counts of the MLP studies: 0 (all of CIFAR-10) or a count, training >= batch_size.

  The generated data of `he_init_depth` (`dataset='synthetic'`) has no 'all': >= 1.
  """
  def check(v, config):
    synthetic = config.get('dataset') == 'synthetic'
    batch = config.get('batch_size', 1)
    least = batch if train and _is_int(batch) else 1
    if not _is_int(v) or v < 0 or (v == 0 and synthetic) or 0 < v < least:
      what = f'batch_size={batch}' if train else '1'
      raise Bad(f'must be an int >= {what}' + ('' if synthetic else ' or 0 (all)'))
  return check


# Accepted names that live in modules importing JAX/flax: looked up only when needed.

def _methods(config=None) -> Sequence[str]:
  from experiments.lib import models  # pylint: disable=g-import-not-at-top
  return models.METHODS


def module_name(v, config):
  """`config.study`: a study module, `'levy_1d'` (in `experiments.studies`) or a dotted path;
  `experiments.main` imports it (and says so when it cannot)."""
  del config
  if not (isinstance(v, str) and v and all(p.isidentifier() for p in v.split('.'))):
    raise Bad('must be a study module name, e.g. levy_1d or mypackage.my_study')


# Field name (or fnmatch pattern, tried in order after the exact names) -> check.
RULES: dict[str, Callable] = {
  # Which study, data.
  'study': module_name,
  'data_dir': optional_str,
  'cache_dir': optional_str,
  'download': boolean,
  'train_examples': COUNT,
  'test_examples': mlp_examples(False),
  'eval_examples': COUNT,
  'image_size': AT_LEAST_ONE,
  'resize_range': resize_range,
  'eval_resize': AT_LEAST_ONE,
  'num_workers': COUNT,
  'num_threads': AT_LEAST_ONE,
  'prefetch': AT_LEAST_ONE,
  # Model.
  'methods': names_list(_methods),
  'depth': AT_LEAST_ONE,
  'hidden': AT_LEAST_ONE,
  'stage_sizes': int_tuple(1),
  'dropout_rate': real(0.0, 1.0, open_high=True),
  'bn_momentum': FRACTION,
  'gmp_glorot_scale': boolean,
  # Optimizer and the Keras protocol.
  'optimizer': choice(OPTIMIZERS),
  'learning_rate': POSITIVE_REAL,
  'momentum': real(0.0, 1.0, open_high=True),
  'nesterov': boolean,
  'weight_decay': real(0.0),
  'decay_names': str_tuple,
  'lr_schedule': choice(LR_SCHEDULES),
  'monitor': choice(MONITORS),
  'monitor_mode': choice(MODES),
  'plateau_factor': FRACTION,
  'plateau_min_delta': real(0.0),
  'decay_factor': real(0.0, 1.0, open_low=True),
  'min_lr': real(0.0),
  'stop_min_delta': real(0.0),
  'restore_best': boolean,
  # Loop.
  'num_epochs': AT_LEAST_ONE,
  'batch_size': AT_LEAST_ONE,
  'eval_batch_size': AT_LEAST_ONE,
  'seed': integer(0, 2**32 - 1),  # NumPy's RandomState (Levy, Banana) takes no more
  'num_seeds': AT_LEAST_ONE,
  'float64': boolean,
  'plots': boolean,
  'mesh_shape': mesh_shape,
  'log_every': AT_LEAST_ONE,
  # Patterns.
  'lr_*': POSITIVE_REAL,
  '*_patience': COUNT,
  '*_cooldown': COUNT,
  '*_fraction': FRACTION,
}


def rule(name: str, rules: Mapping[str, Callable] | None = None) -> Callable | None:
  """The check of field `name`: a study's own `rules` (exact, then patterns), else `RULES`'."""
  for table in (rules or {}, RULES):
    if name in table:
      return table[name]
    for pattern, check in table.items():
      if any(ch in pattern for ch in '*?[') and fnmatch.fnmatchcase(name, pattern):
        return check
  return None


def closest(name: str, valid: Sequence[str]) -> str | None:
  """The valid name closest to `name` (difflib), or None when nothing is close."""
  match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
  return match[0] if match else None


def _did_you_mean(name, valid) -> str:
  near = closest(str(name), [str(v) for v in valid]) if isinstance(name, str) else None
  return f' (did you mean {near!r}?)' if near else ''


def _show(value) -> str:
  return str(value).replace('\n', ' ') if not isinstance(value, str) else value


def unknown_field_message(name: str, valid: Sequence[str]) -> str:
  """`--config.foo`: the one-line message, with the closest valid field(s)."""
  near = closest(name, valid)
  if near:
    return f'--config.{name}: unknown config field; did you mean {near!r}?'
  nearest = difflib.get_close_matches(name, list(valid), n=3, cutoff=0.0)
  return (f'--config.{name}: unknown config field; none is close, the nearest of the '
          f'{len(valid)} fields are {", ".join(map(repr, nearest))}')


def check_config(config, rules: Mapping[str, Callable] | None = None) -> None:
  """Raises `ConfigError` (one line) for the first field that breaks its rule.

  Args:
    config: a flat `ml_collections.ConfigDict` (or a mapping) of a study config.
    rules: the study's own `CONFIG_RULES` (looked up before the shared `RULES`).

  Raises:
    ConfigError: a field has no rule, or its value breaks it (lists what is accepted).
  """
  for name in config:
    if rule(name, rules) is None:
      raise ConfigError(f'--config.{name}: no validation rule for this field; add one to the '
                        "study module's CONFIG_RULES (or to experiments/configs/validate.py "
                        'RULES for a field every study shares)')
    message = field_message(name, config[name], config, rules)
    if message:
      raise ConfigError(message)


def field_message(name: str, value, config, rules=None) -> str | None:
  """The one-line refusal of `--config.name=value` by its rule, or None if the rule accepts it.

  Also explains an override the flag parser could not convert (the raw string):

    >>> field_message('num_epochs', '2.5', {})
    '--config.num_epochs=2.5: must be an int >= 1.'
  """
  check = rule(name, rules)
  try:
    if check is not None:
      check(value, config)
  except Bad as e:
    return f'--config.{name}={_show(value)}: {str(e).rstrip(".")}.'
  return None


# ---------------------------------------------------------------------------
# The data a study reads (checked after the fields, where the config is read).

def check_vision_data(config) -> None:
  """Raises `ConfigError` unless the vision trainer's `config.dataset` can be opened as it will
  be: the CIFAR-10 archive (unless `download`), the image folder's layout (every error
  `image_folder_splits` would raise in the run) or the TFDS splits."""
  from experiments.vision import sources  # pylint: disable=g-import-not-at-top

  name, data_dir = config.get('dataset'), config.get('data_dir')
  train_count = None  # the training split's examples, where known before the run
  try:
    if name == 'cifar10_jpeg':
      check_cifar10(data_dir, config.get('download', False), config.get('cache_dir'))
      train_count = CIFAR10_TRAIN
    elif name == 'image_folder':
      root = sources.resolve_data_dir(data_dir)
      if not root:
        raise ValueError('dataset image_folder needs a folder holding train/<class>/*.jpg and '
                         'val/<class>/*.jpg: set --config.data_dir (or GEOPARAM_DATA_DIR).')
      train_count = len(sources.image_folder_splits(root)[0])
    elif name in sources.TFDS_DATASETS:
      train_split, eval_split, _ = sources.TFDS_DATASETS[name]
      check_tfds_prepared(name, sources.resolve_data_dir(data_dir))
      for split in (train_split, eval_split):
        source = sources.load_tfds(name, split, data_dir)
        if split == train_split:
          train_count = len(source)
  except ConfigError:
    raise
  except ImportError as e:
    raise ConfigError(f'--config.dataset={name}: needs {e.name} (pip install -e '
                      "'.[experiments]').") from None
  except (OSError, ValueError) as e:
    message = ' '.join(str(e).split())  # a wrapped TFDS error may span lines
    raise ConfigError(f'--config.data_dir={data_dir}: {message}') from None
  check_batch_fits(config, train_count)


CIFAR10_TRAIN = 50_000  # the training examples of CIFAR-10 (both archives)


def check_batch_fits(config, train_count: int | None) -> None:
  """Raises `ConfigError` when `batch_size` exceeds the training examples (the run would refuse
  it after loading the data: an epoch needs one full batch)."""
  if train_count is None:
    return
  subset = config.get('train_examples') or 0
  n = min(subset, train_count) if subset else train_count
  batch = config.get('batch_size')
  if _is_int(batch) and batch > n:
    of = (f'--config.train_examples={subset}' if subset and subset < train_count else
          f'the training examples of {config.get("dataset")}')
    raise ConfigError(f'--config.batch_size={batch}: must be at most {n}, {of} (an epoch needs '
                      'one full batch).')


def check_tfds_prepared(name: str, root: str | None) -> None:
  """Raises `ConfigError` unless TFDS dataset `name` has a prepared version under `root` (TFDS's
  own error for a missing dataset would blame the file format)."""
  root = root or os.path.join(os.path.expanduser('~'), 'tensorflow_datasets')  # TFDS's default
  if glob.glob(os.path.join(root, name, '*', 'dataset_info.json')) or glob.glob(
      os.path.join(root, name, '*', '*', 'dataset_info.json')):  # (a config folder between)
    return
  manual = (f' (imagenet2012 needs the ILSVRC tars in {root}/downloads/manual first)'
            if name == 'imagenet2012' else '')
  raise ConfigError(f'--config.data_dir={root}: TFDS dataset {name!r} is not prepared there (no '
                    f'{name}/<version>/dataset_info.json). Prepare it as ArrayRecord{manual}: '
                    f'`tfds build {name} --file_format=array_record --data_dir={root}`, or set '
                    '--config.data_dir (or GEOPARAM_DATA_DIR) to where it is.')


def check_cifar10(data_dir: str | None, download: bool = False,
                  cache_dir: str | None = None) -> None:
  """Raises `ConfigError` unless `data_dir` (or $GEOPARAM_DATA_DIR) holds a complete CIFAR-10
  archive, or holds none and `download` allows fetching one. An archive not yet decoded into
  the cache (`cache_dir`, `sources.decoded_cache`) is read once to its end
  (`sources.check_archive`): a truncated or corrupt one is refused here, not mid-run."""
  from experiments.vision import sources  # pylint: disable=g-import-not-at-top
  resolved = sources.resolve_data_dir(data_dir)
  local = sources.local_cifar10(resolved)
  if local is not None:
    if os.path.isfile(sources.decoded_cache(*local, cache_dir)):
      return  # decoded before, so complete
    try:
      sources.check_archive(local[0])
    except ValueError as e:
      flag = f'--config.data_dir={data_dir}' if data_dir else '$GEOPARAM_DATA_DIR'
      raise ConfigError(f'{flag}: {e}; replace it with a complete copy (--config.data_dir names '
                        'the folder holding it; with no archive there, --config.download=True '
                        'fetches the official one).') from None
    return
  if download:
    return
  names = (sources.JPEG_ARCHIVE, sources.CIFAR10_BINARY)
  fix = ('set --config.data_dir (or GEOPARAM_DATA_DIR) to the folder holding it, or '
         '--config.download=True to fetch the official archive (170 MB).')
  if not data_dir and not os.environ.get('GEOPARAM_DATA_DIR'):
    raise ConfigError(f'--config.data_dir=None: CIFAR-10 needs {names[0]} (or {names[1]}) and no '
                      f'data directory is given (no --config.data_dir, no $GEOPARAM_DATA_DIR); '
                      + fix)
  where = (f'data_dir {resolved!r}' if data_dir else
           f'$GEOPARAM_DATA_DIR={os.environ["GEOPARAM_DATA_DIR"]!r}')
  raise ConfigError(f'--config.data_dir={data_dir}: no {names[0]} (or {names[1]}) in {where}; '
                    + fix)


# ---------------------------------------------------------------------------
# The workdir.

MARKER = 'config.json'  # what every run of experiments.main writes first


RESULTS = 'results.json'  # what a finished study run writes last (experiments.lib.report.write)


def check_workdir(workdir: str, study: str, overwrite: bool = False) -> None:
  """Refuses a workdir that cannot be written or that holds something not ours.

  Ours: absent, empty, or holding the `config.json` of a run of the same study
  (the vision trainer resumes from it) that has not finished: one that wrote its
  `results.json` is refused unless `overwrite` (a `:smoke` run into the workdir of
  a full run would replace its results). Nothing is created here.

  Raises:
    ConfigError: one line saying what is wrong with `workdir`.
  """
  if not workdir:
    raise ConfigError('--workdir: a directory is required.')
  path = os.path.abspath(os.path.expanduser(workdir))
  if os.path.exists(path):
    if not os.path.isdir(path):
      raise ConfigError(f'--workdir={workdir}: exists and is not a directory.')
    if not _can_write_in(path):
      raise ConfigError(f'--workdir={workdir}: not writable.')
    entries = os.listdir(path)
    if not entries:
      return
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
      raise ConfigError(
          f'--workdir={workdir}: not empty and not a workdir of experiments.main (no {MARKER}; '
          f'holds {", ".join(sorted(entries)[:3])}{", ..." if len(entries) > 3 else ""}); '
          'pick a new or empty directory.')
    try:
      with open(marker) as f:
        previous = json.load(f).get('study', 'train')
    except (OSError, ValueError, AttributeError):
      raise ConfigError(f'--workdir={workdir}: {MARKER} is unreadable; pick a new or empty '
                        'directory.') from None
    if previous != study:
      raise ConfigError(f'--workdir={workdir}: holds a run of study {previous!r}, not '
                        f'{study!r}; pick a new or empty directory.')
    if _finished(os.path.join(path, RESULTS)) and not overwrite:
      raise ConfigError(f'--workdir={workdir}: holds the finished results of a {study} run '
                        f'({RESULTS}); pick a new directory, or pass --overwrite to replace '
                        'them.')
    return
  parent = os.path.dirname(path)
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise ConfigError(f'--workdir={workdir}: {parent} is not a directory.')
  if not _can_write_in(parent):
    raise ConfigError(f'--workdir={workdir}: cannot be created ({parent} is not writable).')


def _finished(results: str) -> bool:
  """Whether `results` (a results.json) records a finished run: a study's, or a trainer's whose
  `status` is 'finished' (a preempted one resumes)."""
  if not os.path.isfile(results):
    return False
  try:
    with open(results) as f:
      status = json.load(f).get('status', 'finished')
  except (OSError, ValueError, AttributeError):
    return True
  return status == 'finished'


def _can_write_in(directory: str) -> bool:
  """Whether a file can be made in `directory` (a probe file, removed at once; root included)."""
  if not os.access(directory, os.W_OK | os.X_OK):
    return False
  try:
    fd, probe = tempfile.mkstemp(prefix='.geoparam_probe_', dir=directory)
  except OSError:
    return False
  os.close(fd)
  os.remove(probe)
  return True
