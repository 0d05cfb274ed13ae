"""`python -m experiments.main` refuses bad settings before any work: one line on stderr, exit 2,
no traceback or usage text, and no workdir created; every config field has a validation rule."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from experiments import main as main_lib
from experiments.configs import validate
from tests import cli_fork

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVY = '--config=experiments/configs/levy_1d.py:smoke'
CNN = '--config=experiments/configs/cifar10_cnn.py:smoke'
BANANA = '--config=experiments/configs/banana_2d.py:smoke'
UCI = '--config=experiments/configs/uci_regression.py:smoke'

# (arguments, what the one line says).
BAD_SETTINGS = [
  # Learning rates finite and > 0.
  ([LEVY, '--config.lr_gmp=-0.1'], '--config.lr_gmp=-0.1: must be a finite number > 0.0.'),
  ([LEVY, '--config.lr_gmp=nan'], '--config.lr_gmp=nan: must be a finite number > 0.0.'),
  ([LEVY, '--config.lr_others=inf'], '--config.lr_others=inf: must be a finite number > 0.0.'),
  ([CNN, '--config.learning_rate=-0.1'], '--config.learning_rate=-0.1: must be a finite number'),
  # Epochs, batch sizes, counts.
  ([CNN, '--config.num_epochs=-1'], '--config.num_epochs=-1: must be an int >= 1.'),
  ([LEVY, '--config.num_epochs=0'], '--config.num_epochs=0: must be an int >= 1.'),
  ([CNN, '--config.batch_size=0'], '--config.batch_size=0: must be an int >= 1.'),
  ([CNN, '--config.batch_size=1.5'], '--config.batch_size=1.5: must be an int >= 1.'),
  ([LEVY, '--config.plateau_patience=2.5'], '--config.plateau_patience=2.5: must be an int >= 0.'),
  ([LEVY, '--config.float64=maybe'], '--config.float64=maybe: must be True or False.'),
  ([LEVY, '--config.num_seeds=0'], '--config.num_seeds=0: must be an int >= 1.'),
  ([LEVY, '--config.hidden=0'], '--config.hidden=0: must be an int >= 1.'),
  # Patience: an int >= 0.
  ([LEVY, '--config.plateau_patience=-1'], '--config.plateau_patience=-1: must be an int >= 0.'),
  ([CNN, '--config.stop_patience=-5'], '--config.stop_patience=-5: must be an int >= 0.'),
  # Fractions in (0, 1).
  ([LEVY, '--config.plateau_factor=1.0'],
   '--config.plateau_factor=1.0: must be a finite number in (0.0, 1.0).'),
  ([CNN, '--config.bn_momentum=0'], '--config.bn_momentum=0.0: must be a finite number in (0.0'),
  # Names from their lists.
  ([LEVY, '--config.methods=sp,foo'], 'must be distinct comma-separated names among sp, wn'),
  ([LEVY, '--config.methods=sp,gmpp'], "(did you mean 'gmp'?)"),
  ([LEVY, '--config.methods=sp,sp'], '--config.methods=sp,sp: must be distinct'),
  ([CNN, '--config.method=gmpp'], "--config.method=gmpp: must be one of sp, wn, wn_mbn, bn, "
                                  "gmp, gmp_imn (did you mean 'gmp'?)."),
  ([CNN, '--config.dataset=cifar11'], "(did you mean 'cifar10'?)"),
  ([CNN, '--config.model=resnet51'], "--config.model=resnet51: must be one of cnn, vgg6"),
  ([CNN, '--config.optimizer=adamw'], "--config.optimizer=adamw: must be one of sgd, adam"),
  ([CNN, '--config.monitor=eval_acc'], '--config.monitor=eval_acc: must be one of eval_loss'),
  (['--config=experiments/configs/cifar10_cnn.py:method=foo'],
   "--config.method=foo: must be one of sp, wn"),
  ([BANANA, '--config.download=True', '--config.num_points=100'],
   '--config.num_points=100: must leave at least batch_size=128 training points (80% of '
   'num_points).'),
  # Data the study reads: missing and no download allowed.
  ([BANANA, '--config.data_dir=/nonexistent'], "--config.data_dir=/nonexistent: banana.csv not "
                                               "found (--config.data_dir='/nonexistent')."),
  ([CNN, '--config.data_dir=/nonexistent'], "--config.data_dir=/nonexistent: no cifar10-jpeg"),
  ([CNN, '--config.dataset=image_folder', '--config.data_dir=/nonexistent'],
   "--config.data_dir=/nonexistent: image folder dataset '/nonexistent' does not exist"),
  ([UCI, '--config.data_dir=/nonexistent'], "that directory does not exist. Pass "
                                            "--config.download=True to fetch boston, concrete,"),
  ([UCI, '--config.download=True', '--config.datasets=yacht,nope'],
   "--config.datasets=yacht,nope: unknown datasets ['nope']; valid ("),
  ([UCI, '--config.protocol=dirty'], '--config.protocol=dirty: must be one of reference, clean.'),
  ([UCI, '--config.num_splits=0'], '--config.num_splits=0: must be an int >= 1.'),
  # Layer specs.
  ([CNN, "--config.layers=(16,'X')"], "--config.layers=(16, 'X'): must be a tuple of conv "
                                      "widths (ints >= 1) and 'M'"),
  ([CNN, '--config.layers=(16,0)'], '--config.layers=(16, 0): must be a tuple of conv widths'),
  # Unknown fields, with the closest valid name.
  ([CNN, '--config.foo=1'], '--config.foo: unknown config field; none is close, the nearest'),
  ([LEVY, '--config.epochs=5'], "--config.epochs: unknown config field; did you mean "
                                "'num_epochs'?"),
  ([CNN, '--config.learning_rat=0.1'], "did you mean 'learning_rate'?"),
  # The config file and its argument.
  (['--config=experiments/configs/nope.py'], '--config=experiments/configs/nope.py: cannot read'),
  (['--config=experiments/configs/levy_1d.py:bogus'], "unknown config argument 'bogus'"),
  ([LEVY, 'extra'], "unexpected arguments ['extra']"),
]


def run_main(args):
  """`python -m experiments.main *args` from the repository root, in a child forked from one
  helper interpreter (`tests/cli_fork.py`: no Python start and JAX import per command line)."""
  return cli_fork.run_main(args)


assert_refused = cli_fork.assert_refused


@pytest.mark.parametrize('args, says', BAD_SETTINGS, ids=[' '.join(a[1:]) or a[0]
                                                          for a, _ in BAD_SETTINGS])
def test_bad_setting_exits_2_with_one_line_and_creates_nothing(tmp_path, args, says):
  workdir = tmp_path / 'run'
  assert_refused(run_main([*args, f'--workdir={workdir}']), says)
  assert not workdir.exists()


def test_bad_workdirs(tmp_path):
  foreign = tmp_path / 'foreign'
  foreign.mkdir()
  (foreign / 'notes.txt').write_text('mine')
  a_file = tmp_path / 'file'
  a_file.write_text('')
  other_study = tmp_path / 'cifar'
  other_study.mkdir()
  (other_study / 'config.json').write_text(json.dumps({'dataset': 'cifar10_jpeg'}))
  cases = [
    (foreign, 'not empty and not a workdir of experiments.main (no config.json; holds notes.txt)'),
    (a_file, 'exists and is not a directory'),
    (a_file / 'sub', f'{a_file} is not a directory'),
    ('/proc/geoparam_workdir', 'cannot be created (/proc is not writable)'),
    (other_study, "holds a run of study 'train', not 'levy_1d'"),
  ]
  for workdir, says in cases:
    before = sorted(os.listdir(workdir)) if os.path.isdir(workdir) else None
    assert_refused(run_main([LEVY, f'--workdir={workdir}']), f'--workdir={workdir}: {says}')
    assert (sorted(os.listdir(workdir)) if os.path.isdir(workdir) else None) == before
  assert not os.path.exists('/proc/geoparam_workdir')
  assert_refused(run_main([LEVY]), '--workdir: a directory is required.')
  # Ours: empty, or a run of the same study (rerun or resume); nothing is created by the check.
  ours = tmp_path / 'ours'
  ours.mkdir()
  validate.check_workdir(str(ours), 'levy_1d')
  (ours / 'config.json').write_text(json.dumps({'study': 'levy_1d'}))
  validate.check_workdir(str(ours), 'levy_1d')
  validate.check_workdir(str(tmp_path / 'new' / 'deeper'), 'levy_1d')
  assert sorted(os.listdir(ours)) == ['config.json'] and not (tmp_path / 'new').exists()


def config_variants():
  """Every config file with no argument and with `smoke`."""
  for path in sorted(glob.glob(os.path.join(ROOT, 'experiments', 'configs', '*.py'))):
    if os.path.basename(path) not in ('__init__.py', 'common.py', 'validate.py'):
      for arg in ('', ':smoke'):
        yield os.path.relpath(path, ROOT) + arg


@pytest.mark.parametrize('config_arg', list(config_variants()))
def test_every_config_field_has_a_rule_and_the_defaults_pass(config_arg):
  config = main_lib._load_config(os.path.join(ROOT, config_arg))  # the CLI's own loader
  rules = getattr(main_lib.study_module(config), 'CONFIG_RULES', None)
  missing = [k for k in config if validate.rule(k, rules) is None]
  assert not missing, f'{config_arg}: fields without a rule (the study\'s or shared): {missing}'
  validate.check_config(config, rules)


def test_rules_refuse_what_they_should():
  import ml_collections  # pylint: disable=g-import-not-at-top
  from experiments.vision import train  # pylint: disable=g-import-not-at-top
  good = dict(learning_rate=0.1, batch_size=8, stop_patience=0, plateau_factor=0.5,
              layers=(16, 'M', 32), methods='sp,gmp', lr_gmp=0.1)
  check = lambda c: validate.check_config(c, train.CONFIG_RULES)  # layers: the trainer's field
  check(ml_collections.ConfigDict(good))
  for field, value in [('learning_rate', 0.0), ('learning_rate', float('inf')),
                       ('batch_size', True), ('stop_patience', 2.0), ('plateau_factor', 0.0),
                       ('layers', ('M',)), ('layers', (16.0,)), ('methods', ''),
                       ('lr_gmp', -1e-9)]:
    with pytest.raises(validate.ConfigError, match=f'--config.{field}='):
      check(ml_collections.ConfigDict({**good, field: value}))
  with pytest.raises(validate.ConfigError, match='no validation rule'):
    check(ml_collections.ConfigDict({'brand_new_field': 1}))
  with pytest.raises(validate.ConfigError, match='no validation rule'):
    validate.check_config(ml_collections.ConfigDict({'layers': (16,)}))  # not a shared field


TOY_STUDY = """
import json, os
from experiments.configs import validate

CONFIG_RULES = {'greeting': validate.choice(('hello', 'hi'))}


def check_data(config):
  if config.get('data_dir') == 'missing':
    raise validate.ConfigError('--config.data_dir=missing: no toy data there')


def run(config, workdir):
  with open(os.path.join(workdir, 'toy.json'), 'w') as f:
    json.dump({'greeting': config.greeting, 'epochs': config.num_epochs}, f)
  return 'ran'
"""

TOY_CONFIG = """
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.study = 'toy_pkg_geoparam.toy_study'
  c.greeting = 'hello'
  c.num_epochs = 2  # a shared field: validate.RULES checks it
  c.data_dir = 'here'
  return c
"""


def test_a_new_study_is_one_module_and_one_config(tmp_path):
  """Issue 28 item 1: a toy study from a temporary folder runs through experiments.main with no
  edit under experiments/: its own field rule, its data check, the shared rules and the
  workdir checks all apply."""
  package = tmp_path / 'toy_pkg_geoparam'
  package.mkdir()
  (package / '__init__.py').write_text('')
  (package / 'toy_study.py').write_text(TOY_STUDY)
  config = tmp_path / 'toy_config.py'
  config.write_text(TOY_CONFIG)
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(tmp_path), ROOT])}
  run = lambda *args: subprocess.run([sys.executable, '-m', 'experiments.main',
                                      f'--config={config}', *args], cwd=ROOT, env=env,
                                     capture_output=True, text=True, timeout=120)
  workdir = tmp_path / 'w'
  ok = run(f'--workdir={workdir}', '--config.greeting=hi')
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert json.loads((workdir / 'toy.json').read_text()) == {'greeting': 'hi', 'epochs': 2}
  assert json.loads((workdir / 'config.json').read_text())['study'] == 'toy_pkg_geoparam.toy_study'
  bad = run(f'--workdir={tmp_path / "bad"}', '--config.greeting=hey')  # its own rule, one line
  assert bad.returncode == 2 and bad.stderr.count('\n') == 1, bad.stderr
  assert '--config.greeting=hey: must be one of hello, hi' in bad.stderr
  assert not (tmp_path / 'bad').exists()
  # The same checks in process (what the command line calls): shared rule, data, module.
  sys.path.insert(0, str(tmp_path))
  try:
    for field, value, says in [('num_epochs', 0, '--config.num_epochs=0: must be an int >= 1.'),
                               ('data_dir', 'missing', 'no toy data there'),
                               ('study', 'toy_pkg_geoparam.nope',
                                'no study module toy_pkg_geoparam.nope')]:
      toy = main_lib._load_config(str(config))
      toy[field] = value
      with pytest.raises(validate.ConfigError, match=re.escape(says)):
        main_lib.check(toy, str(tmp_path / 'bad'))
  finally:
    sys.path.remove(str(tmp_path))
  assert not (tmp_path / 'bad').exists()


def test_nothing_under_experiments_imports_main_or_lists_the_studies():
  """No import circle (studies import validate, never main) and no central list of studies."""
  for path in glob.glob(os.path.join(ROOT, 'experiments', '**', '*.py'), recursive=True):
    text = open(path).read()
    assert 'import main' not in text and 'experiments.main import' not in text, path
  for path in (os.path.join(ROOT, 'experiments', 'main.py'),
               os.path.join(ROOT, 'experiments', 'configs', 'validate.py')):
    text = open(path).read()
    assert 'STUDY_RUNNERS' not in text and 'STUDIES' not in text, path


def test_dry_run_checks_everything_and_creates_nothing(tmp_path):
  workdir = tmp_path / 'run'
  ok = run_main([LEVY, '--config.num_seeds=3', f'--workdir={workdir}', '--dry_run'])
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert '"num_seeds": 3' in ok.stdout and 'pass every check' in ok.stdout
  assert not workdir.exists()
  assert_refused(run_main([LEVY, '--config.num_seeds=0', f'--workdir={workdir}', '--dry_run']),
                 '--config.num_seeds=0: must be an int >= 1.')


def test_a_finished_run_is_not_overwritten_without_overwrite(tmp_path):
  """Issue 28: a run into the workdir of a finished run of the same study (a :smoke run into a
  full run's) is refused, one line, unless --overwrite; an unfinished one is resumed/rewritten."""
  workdir = tmp_path / 'levy'
  workdir.mkdir()
  (workdir / 'config.json').write_text(json.dumps({'study': 'levy_1d'}))
  levy = main_lib._load_config(os.path.join(ROOT, LEVY.split('=', 1)[1]))
  main_lib.check(levy, str(workdir))  # no results.json yet: an unfinished run, accepted
  (workdir / 'results.json').write_text('{}')
  assert_refused(run_main([LEVY, f'--workdir={workdir}', '--dry_run']),
                 'holds the finished results of a levy_1d run (results.json); pick a new '
                 'directory, or pass --overwrite to replace them.')
  with pytest.raises(validate.ConfigError, match='--overwrite'):
    main_lib.check(levy, str(workdir))
  main_lib.check(levy, str(workdir), overwrite=True)  # what --overwrite passes
  (workdir / 'results.json').write_text(json.dumps({'status': 'preempted'}))  # the trainer's
  validate.check_workdir(str(workdir), 'levy_1d')  # an unfinished run resumes


def test_help_lists_the_configs_and_a_configs_fields_and_exits_0():
  shown = run_main([LEVY, '--help'])
  assert shown.returncode == 0 and shown.stderr == '', shown.stderr[-2000:]
  assert 'levy_1d ' in shown.stdout and 'cifar10_cnn ' in shown.stdout  # the configs
  assert '--dry_run' in shown.stdout and '--overwrite' in shown.stdout
  assert "--config.study='levy_1d'" in shown.stdout and '--config.num_seeds=' in shown.stdout
  assert 'Add --config=<file> to --help' in main_lib.usage(['experiments.main', '--help'])
