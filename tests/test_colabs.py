"""The colab notebooks: each runs top to bottom in a fresh kernel, and none carries outputs.

Notebooks are committed stripped (no outputs, no execution counts): outputs of a
headless run would go stale with every library change and bloat the diffs. The
execution test runs each notebook with its own small settings in a new IPython
kernel started from THIS interpreter (`sys.executable`, through a kernelspec
written to a temporary JUPYTER_PATH), with the repository root as working
directory, and fails on the first cell that raises.
"""

import ast
import io
import json
import os
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
DATA_DIR = os.environ.get('GEOPARAM_DATA_DIR') or os.path.join(ROOT, '..', 'shared', 'data')
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
  # The first code cell installs geoparam in Colab only; a DATA_DIR setting where data is read.
  first = code[0].source
  assert 'REPO_URL' in first and "'google.colab' in sys.modules" in first
  if name in NEEDS_DATA:
    assert any('GEOPARAM_DATA_DIR' in c.source and 'DATA_DIR =' in c.source for c in code)


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
  monkeypatch.setenv('GEOPARAM_DATA_DIR', os.path.abspath(DATA_DIR))
  monkeypatch.delenv('MPLBACKEND', raising=False)  # the kernel's default: inline figures
  monkeypatch.setenv('TMPDIR', str(tmp_path))  # the notebooks' WORKDIR (tempfile) lands here
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
