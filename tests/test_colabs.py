"""The colab notebooks: each runs top to bottom in a fresh kernel, and none carries outputs.

Notebooks are committed stripped (no outputs, no execution counts): outputs of a
headless run would go stale with every library change and bloat the diffs. The
execution test runs each notebook with its own small settings in a new IPython
kernel started from THIS interpreter (`sys.executable`, through a kernelspec
written to a temporary JUPYTER_PATH), with the repository root as working
directory and the shared data local (any download attempt fails), and fails on
the first cell that raises.

The setup cell (first code cell) carries a copy of the repository URL of
pyproject.toml (`colabs/sync_repo_url.py` keeps it in step) and, outside a
checkout with nothing installed, says what to do; each notebook's top states
what it shows and how long it takes on Colab's CPU and GPU runtimes.
"""

import ast
import importlib.util
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
import tokenize

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLABS = os.path.join(ROOT, 'colabs')
NOTEBOOKS = (
    'quickstart.ipynb',
    'characteristic_activation.ipynb',
    'linearly_constrained_weights.ipynb',
    'uci_and_benchmarks.ipynb',
)
# Notebooks that read the shared data (banana.csv, uci/*.txt).
NEEDS_DATA = {
    'characteristic_activation.ipynb': 'banana.csv',
    'uci_and_benchmarks.ipynb': os.path.join('uci', 'yacht.txt'),
}
SHARED = os.path.join(ROOT, '..', 'shared', 'data')  # the notebooks' fallback beside the checkout
DATA_DIR = os.environ.get('GEOPARAM_DATA_DIR') or SHARED
MAX_CELL_CHARS = 5000
MAX_FILE_BYTES = 60_000


def _read(name):
  with open(os.path.join(COLABS, name), encoding='utf-8') as f:
    return nbformat.read(f, as_version=4)


def test_every_notebook_is_listed():
  found = sorted(n for n in os.listdir(COLABS) if n.endswith('.ipynb'))
  assert found == sorted(NOTEBOOKS)


@pytest.mark.parametrize('name', NOTEBOOKS)
def test_notebook_is_committed_clean(name):
  path = os.path.join(COLABS, name)
  assert os.path.getsize(path) < MAX_FILE_BYTES, f'{name} is {os.path.getsize(path)} bytes'
  nb = _read(name)
  nbformat.validate(nb)
  assert nb.metadata.kernelspec.name == 'python3'
  code = [c for c in nb.cells if c.cell_type == 'code']
  assert code, name
  for i, cell in enumerate(nb.cells):
    where = f'{name} cell {i}'
    assert len(cell.source) <= MAX_CELL_CHARS, f'{where}: {len(cell.source)} characters'
    assert not cell.get('attachments'), f'{where} carries attachments'
    if cell.cell_type != 'code':
      continue
    assert cell.outputs == [], f'{where} carries outputs: strip them before committing'
    assert cell.execution_count is None, f'{where} has execution count {cell.execution_count}'
    # Valid Python once IPython's line magics are removed; blocks indented by 2 spaces.
    body = '\n'.join('' if line.lstrip().startswith('%') else line
                     for line in cell.source.splitlines())
    ast.parse(body, filename=where)
    levels = [0]
    for tok in tokenize.generate_tokens(io.StringIO(body).readline):
      if tok.type == tokenize.INDENT:
        assert tok.string == ' ' * (levels[-1] + 2), f'{where} line {tok.start[0]}: not 2 spaces'
        levels.append(len(tok.string))
      elif tok.type == tokenize.DEDENT:
        levels.pop()
  # The top says what the notebook shows and how long it takes (Colab CPU and GPU runtimes).
  header = nb.cells[0].source
  assert nb.cells[0].cell_type == 'markdown' and header.startswith('# ')
  assert re.search(r'\*\*Time\.\*\* .*Colab CPU runtime.*free Colab GPU', header,
                   re.DOTALL), header
  assert 'estimate' in header.lower()
  # The first code cell installs geoparam in Colab only; a DATA_DIR setting where data is read,
  # with downloads of missing files allowed (so Colab needs no upload).
  first = code[0].source
  assert 'REPO_URL' in first and "'google.colab' in sys.modules" in first
  # Colab installs what the notebook imports: the experiments' extras only for the studies.
  studies = "'experiments'" in first.split('NEEDS = ')[1].splitlines()[0]
  assert ("f'{root}[experiments]'" in first) == studies, name
  assert studies or "'-e', root]" in first, name
  if name in NEEDS_DATA:
    assert any('GEOPARAM_DATA_DIR' in c.source and 'DATA_DIR =' in c.source
               and 'DOWNLOAD = True' in c.source for c in code)
    assert sum(c.source.count('download=DOWNLOAD') for c in code) >= 1


def _sync_module():
  spec = importlib.util.spec_from_file_location('sync_repo_url',
                                                os.path.join(COLABS, 'sync_repo_url.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_repo_url_copies_match_pyproject():
  """The notebooks' REPO_URL and colabs/README.md's Colab links follow pyproject.toml."""
  sync = _sync_module()
  url = sync.repo_url()
  assert url.startswith('https://github.com/')
  proc = subprocess.run([sys.executable, os.path.join(COLABS, 'sync_repo_url.py'), '--check'],
                        capture_output=True, text=True, timeout=60, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  for name in NOTEBOOKS:
    setup = next(c.source for c in _read(name).cells if c.cell_type == 'code')
    assert f"REPO_URL = '{url}'" in setup, name
  # The check sees every copy when the URL changes (nothing is written in this mode).
  stale = sync.stale_files('https://github.com/someone/elsewhere', write=False)
  assert stale == sorted(f'colabs/{n}' for n in NOTEBOOKS) + ['colabs/README.md']


@pytest.mark.parametrize('colab, match', [
    (True, (r"REPO_URL is still the placeholder 'https://github.com/YOUR-ORG/geoparam'.*Set "
            r'REPO_URL above')),
    (False, (r"cannot import \['geoparam', 'experiments'\]: run this notebook from a geoparam "
             r'checkout')),
])
def test_setup_cell_says_what_to_do(tmp_path, colab, match):
  """Outside a checkout and with nothing installed: Colab asks for the URL, elsewhere a checkout.

  The setup cell runs in a subprocess where `find_spec` reports geoparam and experiments as
  absent (as in a fresh Colab runtime) and `subprocess.run` fails the test if called.
  """
  nb = _read('characteristic_activation.ipynb')
  setup = next(c.source for c in nb.cells if c.cell_type == 'code')
  if 'YOUR-ORG' not in setup:
    pytest.skip('REPO_URL is set: the placeholder message no longer applies')
  code = '\n'.join([
      'import importlib.util, subprocess, sys, types',
      f'if {colab}:',
      "  sys.modules['google.colab'] = types.ModuleType('google.colab')",
      '_real = importlib.util.find_spec',
      ("importlib.util.find_spec = lambda n, *a: None if n in ('geoparam', 'experiments') "
       'else _real(n, *a)'),
      "subprocess.run = lambda *a, **k: sys.exit('subprocess.run called: ' + repr(a))",
      f'exec({setup!r})',
  ])
  proc = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, capture_output=True,
                        text=True, timeout=60, check=False)
  assert proc.returncode == 1 and 'subprocess.run called' not in proc.stderr, proc.stderr
  assert re.search(match, proc.stderr, re.DOTALL), proc.stderr[-2000:]


def _kernelspec(tmp_path):
  """A kernelspec running ipykernel in this interpreter; returns (JUPYTER_PATH dir, name)."""
  name = 'geoparam-test-python'
  spec_dir = tmp_path / 'jupyter' / 'kernels' / name
  spec_dir.mkdir(parents=True)
  (spec_dir / 'kernel.json').write_text(json.dumps({
      'argv': [sys.executable, '-m', 'ipykernel_launcher', '-f', '{connection_file}'],
      'display_name': f'Python ({sys.executable})',
      'language': 'python',
  }))
  return str(tmp_path / 'jupyter'), name


@pytest.mark.parametrize('name', NOTEBOOKS)
def test_notebook_executes(name, tmp_path, monkeypatch):
  from nbclient import NotebookClient  # pylint: disable=g-import-not-at-top

  needs = NEEDS_DATA.get(name)
  if needs and not os.path.exists(os.path.join(DATA_DIR, needs)):
    pytest.skip(f'{needs} not in {DATA_DIR} (set GEOPARAM_DATA_DIR)')
  jupyter_path, kernel_name = _kernelspec(tmp_path)
  monkeypatch.setenv('JUPYTER_PATH', jupyter_path)
  if needs and os.path.exists(os.path.join(SHARED, needs)):
    # As from a fresh clone: no GEOPARAM_DATA_DIR, the notebook finds ../shared/data itself.
    monkeypatch.delenv('GEOPARAM_DATA_DIR', raising=False)
  else:
    monkeypatch.setenv('GEOPARAM_DATA_DIR', os.path.abspath(DATA_DIR))
  monkeypatch.delenv('MPLBACKEND', raising=False)  # the kernel's default: inline figures
  monkeypatch.setenv('TMPDIR', str(tmp_path))  # the notebooks' WORKDIR (tempfile) lands here
  # Never a silent download: the data is local, and any fetch would go to a closed loopback
  # port and fail the notebook (cache in tmp_path, so no earlier download is reused either).
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    closed_port = s.getsockname()[1]
  monkeypatch.setenv('GEOPARAM_DATA_URL', f'http://127.0.0.1:{closed_port}/no-downloads-in-tests')
  monkeypatch.setenv('GEOPARAM_CACHE_DIR', str(tmp_path / 'cache'))
  nb = _read(name)
  client = NotebookClient(nb, kernel_name=kernel_name, timeout=600, allow_errors=False,
                          resources={'metadata': {'path': ROOT}})
  t0 = time.perf_counter()
  client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
  seconds = time.perf_counter() - t0
  print(f'{name}: executed in {seconds:.1f} s')
  images = sum('image/png' in out.get('data', {})
               for cell in nb.cells if cell.cell_type == 'code' for out in cell.outputs)
  assert images >= 2, f'{name} showed {images} inline figures'
  errors = [out for cell in nb.cells if cell.cell_type == 'code' for out in cell.outputs
            if out.output_type == 'error']
  assert not errors
