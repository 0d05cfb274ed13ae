"""`python -m experiments.main ARGS` without a new interpreter per command line.

A test command line used to be one subprocess each, and most of its second went into starting
Python and importing JAX, TensorFlow, matplotlib and the studies. Here one helper process
(`Runner`, one per test worker) imports them once, then forks a child per command line: the child
sets `sys.argv` as `python -m experiments.main` does, points its stdout and stderr (file
descriptors 1 and 2) at files and calls `experiments.main.cli()`, the function `python -m
experiments.main` runs; its exit status is the child's. The absl flags are parsed only in the
children, so each starts as a fresh interpreter would. Nothing in the helper initializes a JAX
backend (no threads are forked). matplotlib is imported in the helper, so it reads `MPLBACKEND`
and `MPLCONFIGDIR` there: setting them per command (`env`) has no effect.

  python tests/cli_fork.py TMPDIR   # the helper: one JSON line in (args, cwd), one line out
"""

import atexit
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, 'experiments', 'main.py')


class Runner:
  """Starts the helper; `run(args)` -> `subprocess.CompletedProcess` like `subprocess.run`."""

  def __init__(self):
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join(
        [ROOT] + ([os.environ['PYTHONPATH']] if os.environ.get('PYTHONPATH') else []))}
    self.tmp = tempfile.mkdtemp(prefix='geoparam_cli_fork_')  # the children's stdout, stderr
    self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.tmp], cwd=ROOT,
                                 env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)

  def run(self, args, cwd=ROOT, env=None):
    request = {'args': list(args), 'cwd': str(cwd), 'env': dict(env or {})}
    self.proc.stdin.write(json.dumps(request) + '\n')
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    assert line, f'the helper exited ({self.proc.poll()})'
    out = json.loads(line)
    return subprocess.CompletedProcess([sys.executable, '-m', 'experiments.main', *args],
                                       out['returncode'], out['stdout'], out['stderr'])

  def close(self):
    """Stops the helper at once (it holds nothing; its interpreter's exit would take seconds)."""
    self.proc.kill()
    self.proc.wait()
    self.proc.stdin.close()
    self.proc.stdout.close()
    shutil.rmtree(self.tmp, ignore_errors=True)


_RUNNER = []


def run_main(args, cwd=ROOT, env=None):
  """`python -m experiments.main *args` run from `cwd` by this process's one helper (started on
  first use, shared by the test modules of a worker); `env`: environment variables to set in
  the child (a value of None unsets one)."""
  if not _RUNNER:
    _RUNNER.append(Runner())
    atexit.register(close_runners)
  return _RUNNER[0].run(args, cwd, env)


def close_runners():
  """Stops this process's helper, if it started one (at exit, or earlier: tests/conftest.py)."""
  while _RUNNER:
    _RUNNER.pop().close()


def _child(args, cwd, env, out_path, err_path):
  """In the forked child: `python -m experiments.main *args`, exit status and all."""
  code = 1
  try:
    for name, value in env.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
      f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
      os.dup2(f, fd)
      os.close(f)
    sys.argv = [MAIN, *args]
    from experiments import main  # pylint: disable=g-import-not-at-top
    try:
      main.cli()
      code = 0
    except SystemExit as e:  # what the interpreter does with it
      if e.code is None:
        code = 0
      elif isinstance(e.code, int):
        code = e.code
      else:
        print(e.code, file=sys.stderr)
        code = 1
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    code = 1
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access


def _serve(tmp):
  from experiments import main  # pylint: disable=g-import-not-at-top
  for name in main.config_names():  # import every study (and its imports) once, here
    for arg in ('', ':smoke'):
      main.study_module(main._load_config(os.path.join(main.CONFIG_DIR, name + '.py' + arg)))  # pylint: disable=protected-access
  importlib.import_module('matplotlib.pyplot')  # for the studies' figures: once here, not per child
  out_path, err_path = os.path.join(tmp, 'out'), os.path.join(tmp, 'err')
  for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      _child(request['args'], request['cwd'], request['env'], out_path, err_path)
    _, status = os.waitpid(pid, 0)
    with open(out_path) as f, open(err_path) as g:
      result = {'returncode': os.waitstatus_to_exitcode(status), 'stdout': f.read(),
                'stderr': g.read()}
    sys.stdout.write(json.dumps(result) + '\n')
    sys.stdout.flush()


if __name__ == '__main__':
  sys.path.insert(0, ROOT)
  _serve(sys.argv[1])


def assert_refused(proc, says):
  """A refused setting: rc 2, one line `experiments.main: ...` holding `says`, no traceback."""
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr[-2000:]
  assert lines[0].startswith('experiments.main: ') and says in lines[0], lines[0]
  assert 'Traceback' not in proc.stderr and proc.stdout == ''
