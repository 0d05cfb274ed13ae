"""The wheel: built offline from this checkout, installed into a fresh venv, used there.

The wheel is built with this interpreter's setuptools (`pip wheel --no-build-isolation`, so no
network) from a copy of the checkout (no stale `build/` folder can leak in). It must hold the
`geoparam` package and its metadata only: the studies (`experiments/`) and benchmarks run from
a checkout. The fresh venv gets geoparam from the wheel alone (`--no-deps --no-index`); its
dependencies (jax, flax, ...) come from this interpreter's site-packages through a `.pth` line,
which adds those folders without running their `.pth` files (so the editable install of the
checkout stays invisible there). The sdist (`python -m build`'s other half) leaves the tests
out (they need `experiments/` and the data of a checkout) and rebuilds the same wheel; the wheel's
long description is the short `PYPI.md`, not the README.
"""

import email.parser
import importlib.metadata
import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile

import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_IGNORE = shutil.ignore_patterns('.git', '.venv', 'build', 'dist', '*.egg-info', '__pycache__',
                                 '.pytest_cache', '.hypothesis', '.ruff_cache', 'workdir*')


def _setuptools_version():
  try:
    return tuple(int(p) for p in importlib.metadata.version('setuptools').split('.')[:2])
  except importlib.metadata.PackageNotFoundError:
    return (0, 0)


@pytest.fixture(scope='module')
def wheel(tmp_path_factory):
  """Path of the wheel built from a copy of the checkout."""
  assert _setuptools_version() >= (77, 0), (
      f'setuptools {importlib.metadata.version("setuptools")} cannot build the wheel offline '
      "(pyproject.toml needs >= 77): install the test extra, pip install -e '.[test]'.")
  tmp = tmp_path_factory.mktemp('wheel')
  src, out = tmp / 'src', tmp / 'dist'
  shutil.copytree(ROOT, src, ignore=_IGNORE)
  proc = subprocess.run(
      [sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '--no-index',
       '-q', '-w', str(out), str(src)], capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  wheels = sorted(out.glob('*.whl'))
  assert len(wheels) == 1, wheels
  return wheels[0]


def _pyproject_version():
  import tomllib  # pylint: disable=g-import-not-at-top  (Python >= 3.11)

  with open(os.path.join(ROOT, 'pyproject.toml'), 'rb') as f:
    return tomllib.load(f)['project']


def test_wheel_holds_the_library_only(wheel):
  project = _pyproject_version()
  dist_info = f'geoparam-{project["version"]}.dist-info'
  assert wheel.name == f'geoparam-{project["version"]}-py3-none-any.whl'
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    metadata = email.parser.Parser().parsestr(z.read(f'{dist_info}/METADATA').decode())
    license_text = z.read(f'{dist_info}/licenses/LICENSE').decode()
    top_level = z.read(f'{dist_info}/top_level.txt').decode().split()
  assert {n.split('/')[0] for n in names} == {'geoparam', dist_info}
  assert top_level == ['geoparam']
  # Every module of the package (subpackages included) and the native map's C++ source are
  # there, and nothing else.
  source = sorted(os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, '/')
                  for d, _, files in os.walk(os.path.join(ROOT, 'geoparam'))
                  if '__pycache__' not in d for f in files if f.endswith(('.py', '.cc')))
  assert 'geoparam/native_map.cc' in source
  assert sorted(n for n in names if n.startswith('geoparam/')) == source
  with open(os.path.join(ROOT, 'LICENSE')) as f:
    assert license_text == f.read() and 'Apache License' in license_text
  assert metadata['Name'] == 'geoparam' and metadata['Version'] == project['version']
  assert metadata['License-Expression'] == 'Apache-2.0'
  assert metadata['Requires-Python'] == project['requires-python']
  assert metadata.get_all('Project-URL') == [
      f'Repository, {project["urls"]["Repository"]}']
  requires = {str(Requirement(r)) for r in metadata.get_all('Requires-Dist')}
  for dep in project['dependencies']:
    assert str(Requirement(dep)) in requires, (dep, requires)
  assert set(metadata.get_all('Provides-Extra')) == {'docs', 'experiments', 'test'}
  assert metadata['Summary'].startswith('Geometric parameterization (GmP)')
  # `python -m build` (the command of docs/getting_started.md) comes with the test extra.
  assert 'build>=1.2; extra == "test"' in {
      str(Requirement(r)) for r in metadata.get_all('Requires-Dist')}
  # The long description is PYPI.md, short, pointing to the repository (not the README).
  with open(os.path.join(ROOT, 'PYPI.md'), encoding='utf-8') as f:
    assert metadata.get_payload().strip() == f.read().strip()
  assert metadata['Description-Content-Type'] == 'text/markdown'
  assert metadata.get_payload().startswith('# geoparam')
  assert len(metadata.get_payload()) < 4000 and 'the **Repository** link' in metadata.get_payload()


@pytest.fixture(scope='module')
def sdist(tmp_path_factory):
  """Path of the sdist built from a copy of the checkout, offline (setuptools' build_sdist, what
  `python -m build --sdist --no-isolation` calls)."""
  tmp = tmp_path_factory.mktemp('sdist')
  src, out = tmp / 'src', tmp / 'dist'
  shutil.copytree(ROOT, src, ignore=_IGNORE)
  proc = subprocess.run(
      [sys.executable, '-c',
       f'from setuptools import build_meta; build_meta.build_sdist({str(out)!r})'],
      cwd=src, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  sdists = sorted(out.glob('*.tar.gz'))
  assert len(sdists) == 1, sdists
  return sdists[0]


def test_sdist_leaves_the_tests_out_and_rebuilds_the_wheel(sdist, wheel, tmp_path):
  """The tests need experiments/ and the data of a checkout: not in the sdist, which holds what
  rebuilds the wheel (the same files as the one built from the checkout)."""
  version = _pyproject_version()['version']
  with tarfile.open(sdist) as t:
    names = [n.split('/', 1)[1] for n in t.getnames() if '/' in n]
    t.extractall(tmp_path, **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))
  top = {n.split('/')[0] for n in names}
  assert top == {'geoparam', 'geoparam.egg-info', 'LICENSE', 'MANIFEST.in', 'PKG-INFO',
                 'PYPI.md', 'README.md', 'pyproject.toml', 'setup.cfg'}, sorted(top)
  assert not any(n.endswith(('.pyc', '.pyo')) for n in names)
  out = tmp_path / 'dist'
  proc = subprocess.run(
      [sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '--no-index',
       '-q', '-w', str(out), str(tmp_path / f'geoparam-{version}')],
      capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  (rebuilt,) = out.glob('*.whl')
  with zipfile.ZipFile(rebuilt) as a, zipfile.ZipFile(wheel) as b:
    assert sorted(a.namelist()) == sorted(b.namelist())


def test_wheel_installs_and_runs_in_a_fresh_venv(wheel, tmp_path):
  venv = tmp_path / 'venv'
  subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True,
                 timeout=120)
  python = str(venv / 'bin' / 'python')
  # Without PYTHONPATH: a checkout on it (its geoparam.egg-info) would make pip see geoparam as
  # installed already and install nothing.
  env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'PYTHONHOME')}
  proc = subprocess.run(
      [sys.executable, '-m', 'pip', '--python', python, 'install', '--no-deps', '--no-index', '-q',
       str(wheel)], capture_output=True, text=True, timeout=300, check=False, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  purelib = subprocess.run([python, '-c', 'import sysconfig; print(sysconfig.get_path("purelib"))'],
                           capture_output=True, text=True, check=True).stdout.strip()
  with open(os.path.join(purelib, '_test_dependencies.pth'), 'w') as f:
    f.write('\n'.join(site.getsitepackages()) + '\n')
  code = """
import importlib.metadata, importlib.util, os, jax, jax.numpy as jnp, geoparam
print(os.path.dirname(geoparam.__file__))
print(importlib.metadata.version('geoparam'))
print(importlib.util.find_spec('experiments'), importlib.util.find_spec('benchmarks'))
layer = geoparam.GmPDense(3)
x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
params = layer.init(jax.random.PRNGKey(0), x)
y = layer.apply(params, x)
print(y.shape, bool(jnp.all(jnp.isfinite(y))), bool(jnp.all(y >= 0)))
print(geoparam.native.available() or geoparam.native.unavailable_reason().splitlines()[0])
"""
  with open(os.path.join(ROOT, 'PYPI.md'), encoding='utf-8') as f:  # its example runs there too
    code += re.search(r'```python\n(.*?)```', f.read(), re.DOTALL).group(1) + 'print(y.shape)\n'
  env['JAX_PLATFORMS'] = 'cpu'
  env['GEOPARAM_CACHE_DIR'] = str(tmp_path / 'cache')  # the native map built from the wheel's copy
  proc = subprocess.run([python, '-c', code], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  where, version, specs, result, built, pypi_example = proc.stdout.strip().splitlines()
  assert where == os.path.join(purelib, 'geoparam')  # the wheel's copy, not the checkout
  assert version == _pyproject_version()['version']
  assert specs == 'None None'  # no top-level experiments / benchmarks packages
  assert result == '(2, 3) True True'
  if shutil.which(os.environ.get('CXX') or 'c++') and os.environ.get('GEOPARAM_NATIVE') != '0':
    assert built == 'True', built
  assert pypi_example == '(2, 3)'
