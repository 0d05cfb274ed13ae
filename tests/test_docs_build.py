"""The documentation site builds with warnings as errors, and has an entry for every public name.

`python -m sphinx -W --keep-going -b html docs OUT` (the command of the README, into a temporary
folder). The notebooks are rendered, not executed (tests/test_colabs.py executes them). Two small
builds show that the checks can fail: a public function without a docstring, and a reference to
a name that does not exist.
"""

import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, 'docs')


def sphinx(source, out, timeout=300):
  return subprocess.run(
      [sys.executable, '-m', 'sphinx', '-W', '--keep-going', '-q', '-b', 'html',
       '-d', str(out / 'doctrees'), str(source), str(out / 'html')],
      cwd=ROOT, capture_output=True, text=True, timeout=timeout,
      env={**os.environ, 'PYTHONPATH': os.pathsep.join(filter(None, [ROOT, os.environ.get(
          'PYTHONPATH')]))})


@pytest.fixture(scope='module')
def site(tmp_path_factory):
  out = tmp_path_factory.mktemp('site')
  proc = sphinx(DOCS, out)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  return out / 'html'


def test_the_site_builds_with_warnings_as_errors(site):
  for page in ('index', 'getting_started', 'library', 'reparameterize', 'paper_002',
               'robustness', 'paper_003_001', 'trainer', 'speed', 'reproducibility',
               'measured_runs', 'notebooks', 'notebooks/quickstart', 'api'):
    assert (site / f'{page}.html').is_file(), page
  assert (site / '_images').is_dir() and any((site / '_images').iterdir())  # the figures


def test_every_public_name_has_an_api_entry(site):
  import geoparam  # pylint: disable=g-import-not-at-top
  modules, queue = [], ['geoparam', 'geoparam.linen', 'geoparam.nnx', 'geoparam.methods']
  while queue:
    name = queue.pop(0)
    if name in modules:
      continue
    modules.append(name)
    module = importlib.import_module(name)
    page = (site / 'api' / f'{name}.html').read_text(encoding='utf-8')
    for attr in module.__all__:
      obj = getattr(module, attr)
      if inspect.ismodule(obj):
        queue.append(obj.__name__)
      else:
        assert f'id="{name}.{attr}"' in page, f'{name}.{attr} has no entry in api/{name}.html'
  assert 'geoparam.linen.transform' in modules and len(modules) > 10, modules
  del geoparam


MINI_CONF = '''
import importlib.util, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location('geoparam_docs_conf', {conf!r})
docs_conf = importlib.util.module_from_spec(spec)
os.environ['GEOPARAM_DOCS_NO_API'] = '1'  # (no API pages of geoparam here)
spec.loader.exec_module(docs_conf)
extensions = [e for e in docs_conf.extensions if e != 'sphinx_copybutton']
nitpicky, nitpick_ignore_regex = docs_conf.nitpicky, docs_conf.nitpick_ignore_regex
exclude_patterns = ['_build']

def setup(app):
  app.connect('autodoc-process-docstring', docs_conf.process_docstring, priority=400)
'''


@pytest.mark.parametrize('body, says', [
    ('.. autofunction:: mini.undocumented', 'function mini.undocumented has no docstring'),
    ('.. autofunction:: mini.documented\n\nSee :func:`mini.nowhere`.',
     'reference target not found: mini.nowhere'),
])
def test_a_missing_docstring_or_a_broken_reference_fails(tmp_path, body, says):
  (tmp_path / 'conf.py').write_text(MINI_CONF.format(conf=os.path.join(DOCS, 'conf.py')))
  (tmp_path / 'mini.py').write_text(textwrap.dedent('''
      def undocumented(x):
        return x

      def documented(x):
        """Returns `x`."""
        return x
      '''))
  (tmp_path / 'index.rst').write_text(f'Mini\n====\n\n{body}\n')
  proc = sphinx(tmp_path, tmp_path / '_build', timeout=120)
  assert proc.returncode != 0 and says in proc.stderr, proc.stderr[-3000:]
  assert re.search('warning', proc.stderr, flags=re.I)
