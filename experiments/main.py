r"""Runs a study from a config file and a workdir: `python -m experiments.main`.

  python -m experiments.main --config=experiments/configs/levy_1d.py:smoke \
      --workdir=/tmp/levy_smoke --config.num_seeds=2

  python -m experiments.main --config=experiments/configs/cifar10_cnn.py:smoke \
      --workdir=/tmp/cifar10_smoke

A study is one module and one config: `config.study` names the module
(`'levy_1d'` is `experiments.studies.levy_1d`; a dotted name such as
`'mypackage.my_study'` any importable module; a config without the field runs
the vision trainer, `experiments.vision.train`), which has `run(config, workdir)`, and
may have `CONFIG_RULES` (checks of its own fields, before the shared
`experiments.configs.validate.RULES`) and `check_data(config)`. Every field, the
`--config.x=` overrides included, the study's data (unless `download`) and the
workdir are checked before any work: a bad setting is one line on stderr, exit
status 2, and no workdir is created. Nothing here lists the studies.

Several hosts (vision studies): the same command on every host plus
`--coordinator_address`, `--num_processes` and `--process_id` (or
`--distributed_auto` on TPU pods and clusters JAX detects itself).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from experiments.configs import validate

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file (a get_config(arg) python file).',
                                lock_config=True)
flags.DEFINE_string('workdir', None, 'Directory for results, metrics and checkpoints.')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0 (multi-host).')
flags.DEFINE_integer('num_processes', None, 'Number of processes (multi-host).')
flags.DEFINE_integer('process_id', None, 'Index of this process (multi-host).')
flags.DEFINE_bool('distributed_auto', False, 'jax.distributed.initialize() with auto-detection.')
flags.DEFINE_bool('overwrite', False, 'Run into a workdir that holds the finished results of the '
                  'same study, replacing them (refused otherwise).')
flags.DEFINE_bool('dry_run', False, 'Check the config, its data and the workdir, print the config '
                  'and exit without running or creating anything.')

EXIT_BAD_SETTING = 2
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs')


def _config_argument(argv) -> str | None:
  """The last `--config=VALUE` (or `--config VALUE`) of `argv`."""
  value = None
  for i, arg in enumerate(argv):
    m = re.match(r'^--?config(=(.*))?$', arg)
    if m:
      value = m.group(2) if m.group(1) else (argv[i + 1] if i + 1 < len(argv) else None)
  return value


def _overrides(argv) -> list[str]:
  """Top-level field names of the `--config.x=` overrides in `argv`."""
  return [m.group(2) for m in (re.match(r'^--?(no)?config\.([^=.]+)', a) for a in argv) if m]


def _load_config(value: str):
  """`get_config(arg)` of `--config=PATH[:arg]`, as ml_collections would call it."""
  path, colon, arg = value.partition(':')
  spec = importlib.util.spec_from_file_location('_checked_config', path)
  if spec is None or not os.path.isfile(path):
    raise OSError(f'no config file {path!r}')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if colon else module.get_config()


def _one_line(error: BaseException) -> str:
  """The message of `error` on one line (the last line of a wrapped traceback)."""
  lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
  return lines[-1] if lines else type(error).__name__


def _diagnose(argv, error: BaseException) -> str:
  """One line for a failure while parsing the flags (config file, overrides, types)."""
  path = _config_argument(argv)
  if path:
    try:
      fields = list(_load_config(path).keys())
    except Exception as e:  # pylint: disable=broad-except
      return f'--config={path}: {_one_line(e)}'
    for name in _overrides(argv):
      if name not in fields:
        return validate.unknown_field_message(name, fields)
  message = _one_line(error)
  m = re.match(r'^flag --config\.(\w+)=(.*?): ', message)
  if m:  # a value the parser could not convert to the field's type: say what the rule accepts
    return validate.field_message(m.group(1), m.group(2), {}) or message[len('flag '):]
  return message[len('flag '):] if message.startswith('flag --') else message


def usage(argv) -> str:
  """`--help`: how to run, the config files (first docstring line each) and, with `--config`,
  that config's fields and values."""
  import ast  # pylint: disable=g-import-not-at-top
  lines = [__doc__.strip(), '', 'Configs (--config=experiments/configs/<name>.py[:arg]):']
  for name in config_names():
    with open(os.path.join(CONFIG_DIR, f'{name}.py')) as f:
      doc = (ast.get_docstring(ast.parse(f.read())) or '').strip().splitlines()
    lines.append(f'  {name:24s}{doc[0] if doc else ""}')
  value = _config_argument(argv)
  if value:
    try:
      config = _load_config(value)
      lines += ['', f'Fields of --config={value} (set any with --config.<field>=<value>):']
      lines += [f'  --config.{k}={config[k]!r}' for k in sorted(config.keys())]
    except Exception as e:  # pylint: disable=broad-except
      lines += ['', f'--config={value}: {_one_line(e)}']
  else:
    lines += ['', 'Add --config=<file> to --help to list that config\'s --config.<field> '
              'settings.']
  lines += ['', 'Flags: --config, --workdir, --dry_run (check the settings, the data and the '
            'workdir, print the config, run nothing), --overwrite, --coordinator_address, '
            '--num_processes, --process_id, --distributed_auto (several hosts); --helpfull '
            "lists absl's own flags too."]
  return '\n'.join(lines)


def config_names() -> list[str]:
  """The config files under experiments/configs (without `.py`)."""
  return sorted(n[:-3] for n in os.listdir(CONFIG_DIR)
                if n.endswith('.py') and n not in ('__init__.py', 'common.py', 'validate.py'))


def parse_flags(argv):
  """Parses the flags and checks the config and workdir; exits 2 with one line if refused."""
  prog = os.path.basename(argv[0]) if argv else 'experiments.main'
  if prog in ('main.py', '__main__.py', '-m'):
    prog = 'experiments.main'
  if any(a in ('--help', '-h', '-?', '--helpshort') for a in argv[1:]):
    print(usage(argv))
    sys.exit(0)
  try:
    try:
      rest = FLAGS(argv)
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
      raise validate.ConfigError(_diagnose(argv, e)) from None
    if len(rest) > 1:
      raise validate.ConfigError(f'unexpected arguments {rest[1:]}; settings are --config.x=...')
    if FLAGS.config is None:
      raise validate.ConfigError('--config: a config file is required, e.g. '
                                 '--config=experiments/configs/levy_1d.py:smoke')
    try:
      fields = list(FLAGS.config.keys())
    except OSError as e:
      raise validate.ConfigError(
          f'--config={_config_argument(argv)}: cannot read the config file ({_one_line(e)})'
      ) from None
    del fields
    check(FLAGS.config, FLAGS.workdir, FLAGS.overwrite)
  except validate.ConfigError as e:
    print(f'{prog}: {e}', file=sys.stderr)
    sys.exit(EXIT_BAD_SETTING)
  return rest


def write_config(config, workdir: str) -> None:
  """`workdir/config.json` (what marks a workdir as ours, see `validate.check_workdir`)."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, validate.MARKER), 'w') as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))


def study_module(config):
  """The module of `config.study` (`experiments.studies.<study>`; `'train'`, the default, is the
  vision trainer `experiments.vision.train`; or a dotted module path), with `run`.

  Raises `validate.ConfigError` naming the field when it cannot be imported or has no `run`.
  """
  study = config.get('study', 'train')
  name = (study if '.' in study else
          'experiments.vision.train' if study == 'train' else f'experiments.studies.{study}')
  try:
    module = importlib.import_module(name)
  except ImportError as e:
    if e.name is not None and not name.startswith(e.name) and e.name != name:
      raise  # the study exists but imports something missing: show it
    raise validate.ConfigError(f'--config.study={study}: no study module {name} (a module '
                               'with run(config, workdir)).') from None
  if not callable(getattr(module, 'run', None)):
    raise validate.ConfigError(f'--config.study={study}: module {name} has no '
                               'run(config, workdir).')
  return module


def check(config, workdir: str, overwrite: bool = False):
  """Checks `config` (its study's `CONFIG_RULES`, then the shared rules), the study's data
  (`check_data`) and `workdir` (`overwrite`: see `validate.check_workdir`); returns the study
  module. Raises `validate.ConfigError`."""
  validate.check_config({'study': config.get('study', 'train')})
  module = study_module(config)
  validate.check_config(config, getattr(module, 'CONFIG_RULES', None))
  if hasattr(module, 'check_data'):
    module.check_data(config)
  validate.check_workdir(workdir, config.get('study', 'train'), overwrite)
  return module


def run(config, workdir: str):
  """Runs the study of `config` (already checked) in `workdir`."""
  module = study_module(config)
  if FLAGS.is_parsed():  # several hosts: the same command on each (a no-op for one process)
    from experiments.vision import sharding  # pylint: disable=g-import-not-at-top
    sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                    FLAGS.process_id, auto=FLAGS.distributed_auto)
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() == 0:
    write_config(config, workdir)
  return module.run(config, workdir)


def run_study(study: str, workdir: str, arg: str | None = None, *, overwrite: bool = False,
              **fields):
  """Runs a study from Python exactly as the command line does, and returns what it returns.

  `run_study('levy_1d', DIR, 'smoke', num_seeds=3)` is `python -m experiments.main
  --config=experiments/configs/levy_1d.py:smoke --config.num_seeds=3 --workdir=DIR`:
  the same config file, the same checks of every field, the data and the
  workdir (a bad setting raises `validate.ConfigError`, a `ValueError`, before
  any work), the same `config.json`. Notebooks use it.

  Args:
    study: a config file name under experiments/configs (e.g. 'levy_1d', or a vision
      config such as 'cifar10_cnn').
    workdir: the directory the study writes to.
    arg: the config's argument (`'smoke'`, `'method=gmp,smoke'`), or None.
    overwrite: `--overwrite` (replace the finished results of the same study in `workdir`).
    **fields: config fields to override (a sequence for a comma-separated names field
      such as `methods` is joined).
  """
  path = os.path.join(CONFIG_DIR, f'{study}.py')
  if not os.path.isfile(path):
    raise validate.ConfigError(f'study={study!r}: no config file {path}; configs: '
                               f'{", ".join(config_names())}.')
  config = _load_config(f'{path}:{arg}' if arg is not None else path)
  for name, value in fields.items():
    if name not in config:
      raise validate.ConfigError(validate.unknown_field_message(name, list(config.keys())))
    if isinstance(value, (list, tuple)) and isinstance(config[name], str):
      value = ','.join(value)
    try:
      config[name] = value
    except (TypeError, ValueError) as e:
      raise validate.ConfigError(validate.field_message(name, value, config) or
                                 f'--config.{name}={value!r}: {_one_line(e)}') from None
  check(config, workdir, overwrite)
  return run(config, workdir)


def main(argv):
  del argv  # checked in parse_flags
  if FLAGS.dry_run:
    print(FLAGS.config.to_json_best_effort(indent=2, sort_keys=True))
    print(f'experiments.main: dry run: the settings pass every check; '
          f'{FLAGS.config.get("study", "train")} would write to {FLAGS.workdir}')
    return
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  run(FLAGS.config, FLAGS.workdir)


def cli():
  """The command line."""
  app.run(main, flags_parser=parse_flags)


if __name__ == '__main__':
  cli()
