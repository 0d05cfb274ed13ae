"""The README's study commands run as written: each is checked by `experiments.main --dry_run`.

Every `python -m experiments.main ...` command of README.md, in code blocks and inline, without
placeholders
other than the workdir `DIR`, must pass every check of its config, data and workdir.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands() -> list[str]:
  with open(os.path.join(ROOT, 'README.md')) as f:
    text = f.read()
  pieces = []
  for lang, block in re.findall(r'^```(\w*)\n(.*?)^```', text, flags=re.S | re.M):
    if lang in ('', 'bash', 'sh'):
      pieces += re.sub(r'\\\n\s*', ' ', block).splitlines()
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
      commands.append(f'experiments.{m.group(1)}{m.group(2)}'.strip())
  return sorted(set(commands))


COMMANDS = readme_commands()


def test_the_readme_has_study_commands():
  assert any('levy_1d.py ' in c for c in COMMANDS) and len(COMMANDS) >= 4, COMMANDS


@pytest.mark.parametrize('command', COMMANDS)
def test_readme_command_passes_its_checks(command, tmp_path):
  args = shlex.split(command)
  args = [re.sub(r'^--workdir=.*', f'--workdir={tmp_path / "w"}', a) for a in args]
  assert any(a.startswith('--workdir=') for a in args), command
  env = dict(os.environ)
  env.setdefault('GEOPARAM_DATA_DIR', os.path.join(ROOT, '..', 'shared', 'data'))
  proc = subprocess.run([sys.executable, '-m', *args, '--dry_run'], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, (command, proc.stderr[-2000:])
  assert 'pass every check' in proc.stdout
  assert not (tmp_path / 'w').exists()
