"""The study commands of README.md and of the documentation pages run as pasted.

Every `python -m experiments.main ...` command of README.md and docs/*.md (in ```bash blocks and
inline; a `for` loop's variables take their first value; placeholders other than the workdir
`DIR` skip it) must pass every check of its config, data and workdir: each runs as the command
line runs it (`experiments.main`'s absl entry point, with `--dry_run`) and `GEOPARAM_DATA_DIR`
unset (as in a fresh shell: a command that needs data must say where it is), and so does its
`:smoke` variant where the config has one. One helper process per test worker
(`tests/cli_fork.py`, shared with the other command-line tests) imports the studies once and
forks a child per command, so the ~35 commands take seconds, not a process start each. The studies'
runs themselves are run by their own tests (the README's Levy command in test_levy_1d.py, smoke
runs in test_banana_2d.py, test_uci_regression.py, test_robustness.py, test_vision_studies.py,
...).
"""

import glob
import importlib
import os
import re
import shlex

import pytest

from tests import cli_fork

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_DATA_DIR = {'GEOPARAM_DATA_DIR': None}  # cli_fork's child runs as a fresh shell without it
PAGES = ['README.md'] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'docs', '*.md')))


def first_loop_values(block: str) -> str:
  """`for m in a b; do ... $m ... done` -> the body with `$m` (and `${m}`) set to `a`."""
  for var, values in re.findall(r'for (\w+) in ([^;]+); do', block):
    first = values.split()[0]
    block = re.sub(rf'\$\{{{var}\}}|\${var}\b', first, block)
  block = re.sub(r'for \w+ in [^;]+; do', '', block)
  return re.sub(r'\bdone;?', '', block)


def page_commands(text: str) -> list[str]:
  """The `experiments.main` commands of a page, as arguments after `python -m`."""
  pieces = []
  for lang, block in re.findall(r'^```([^\n]*)\n(.*?)^```', text, flags=re.S | re.M):
    if lang.strip() in ('', 'bash', 'sh'):  # (not a MyST directive such as {figure})
      pieces += re.sub(r'\\\n\s*', ' ', first_loop_values(block)).splitlines()
  prose = re.sub(r'^```.*?^```', '', text, flags=re.S | re.M)
  pieces += [' '.join(c.split()) for c in re.findall(r'`([^`]*-m experiments\.[^`]*)`', prose)]
  commands = []
  for piece in pieces:
    for part in piece.split('&&'):
      part = part.split(' #')[0].strip()
      m = re.search(r'(?:\.venv/bin/)?python -m experiments\.(\w+)(.*)', part)
      if not m or any(c in part for c in '[]$<>') or '...' in part:
        continue
      if m.group(1) != 'main':
        continue
      command = ' '.join(f'experiments.{m.group(1)}{m.group(2)}'.split())
      commands.append(re.sub(r'--workdir=\S+', '--workdir=DIR', command))  # (the test's own)
  return commands


def smoke_variant(command: str) -> str | None:
  """The command with `smoke` added to its config's argument, if that config accepts it."""
  m = re.search(r'--config=experiments/configs/(\w+)\.py(?::(\S+))?', command)
  if not m or 'smoke' in (m.group(2) or '').split(','):
    return None
  arg = ','.join(filter(None, [m.group(2), 'smoke']))
  try:
    importlib.import_module(f'experiments.configs.{m.group(1)}').get_config(arg)
  except (ValueError, TypeError, KeyError, AttributeError):
    return None
  return command.replace(m.group(0), f'--config=experiments/configs/{m.group(1)}.py:{arg}')


def all_commands() -> dict[str, str]:
  """command -> the first page that gives it (and its :smoke variants, marked)."""
  found = {}
  for page in PAGES:
    with open(os.path.join(ROOT, page), encoding='utf-8') as f:
      for command in page_commands(f.read()):
        found.setdefault(command, page)
  for command, page in list(found.items()):
    smoke = smoke_variant(command)
    if smoke:
      found.setdefault(smoke, f'{page} (:smoke)')
  return found


COMMANDS = all_commands()


def test_the_pages_have_study_commands():
  pages = set(COMMANDS.values())
  assert {'README.md', 'docs/paper_002.md', 'docs/robustness.md', 'docs/trainer.md'} <= pages
  assert any('levy_1d.py ' in c for c in COMMANDS) and len(COMMANDS) >= 20, COMMANDS
  assert any(':smoke' in c or ',smoke' in c for c in COMMANDS)


def test_loops_take_their_first_values():
  block = 'for m in sp wn; do\n  python -m experiments.main --config=x.py:method=$m --out=a_${m}\ndone\n'
  assert page_commands(f'```bash\n{block}```\n') == [
      'experiments.main --config=x.py:method=sp --out=a_sp']


@pytest.fixture(scope='module')
def dry_runs(tmp_path_factory):
  """command -> (exit status, output, workdir) of its dry run, without $GEOPARAM_DATA_DIR:
  `python -m experiments.main` in a forked child of the worker's helper (tests/cli_fork.py)."""
  results = {}
  for command in sorted(COMMANDS):
    workdir = tmp_path_factory.mktemp('doc_command') / 'w'
    args = shlex.split(command)[1:]  # (after experiments.main)
    assert '--workdir=DIR' in args, command
    args = [f'--workdir={workdir}' if a == '--workdir=DIR' else a for a in args]
    proc = cli_fork.run_main(args if '--dry_run' in args else args + ['--dry_run'],
                             env=NO_DATA_DIR)
    results[command] = (proc.returncode, proc.stdout + proc.stderr, workdir)
  return results


@pytest.mark.parametrize('command', sorted(COMMANDS), ids=lambda c: c[len('experiments.main '):])
def test_command_passes_its_checks(command, dry_runs):
  rc, output, workdir = dry_runs[command]
  assert rc == 0 and 'pass every check' in output, (COMMANDS[command], command, output[-2000:])
  assert not workdir.exists()


def test_a_command_without_its_data_fails():
  """The check can fail: the Banana study needs --config.data_dir when GEOPARAM_DATA_DIR is unset."""
  proc = cli_fork.run_main(['--config=experiments/configs/banana_2d.py:smoke',
                            '--workdir=/nonexistent/w', '--dry_run'],
                           env=NO_DATA_DIR)
  assert proc.returncode == 2 and 'banana.csv not found' in proc.stdout + proc.stderr, proc.stderr
