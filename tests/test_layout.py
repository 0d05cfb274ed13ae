"""The library's shape: the core and the NNX shell import no linen; the methods no Flax framework;
each shell is one folder (geoparam/linen/, geoparam/nnx/)."""

import ast
import json
import os
import pathlib
import subprocess
import sys

import geoparam

ROOT = pathlib.Path(geoparam.__file__).parent

# The framework-neutral core and the study tools (top-level modules of geoparam/).
CORE = ('methods', 'kinds', 'exact', 'selection', 'hyperspherical', 'lcw', 'conv', 'normalization',
        'activations', 'initializers', 'he_init', 'masks', 'variance', 'checks')
STUDY_TOOLS = ('analysis', 'schedules', 'convert')
# The modules that moved into geoparam/linen/ (no module is left at these paths).
OLD_PATHS = ('geoparam.wrappers', 'geoparam.transform', 'geoparam.gmp', 'geoparam.baselines',
             'geoparam.linear_constrained')


def _imports(path: pathlib.Path) -> set[str]:
  """Module names `path` imports (`from a import b` gives `a` and `a.b`)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f'{node.module}.{a.name}' for a in node.names)
  return names


def _within(name: str, package: str) -> bool:
  """`name` is `package` or one of its modules (or names)."""
  return name == package or name.startswith(package + '.')


def _file(module: str) -> pathlib.Path | None:
  rel = pathlib.Path(*module.split('.')[1:])
  candidates = [ROOT / '__init__.py'] if module == 'geoparam' else [
      ROOT / rel.with_suffix('.py'), ROOT / rel / '__init__.py']
  return next((c for c in candidates if c.exists()), None)


def _reachable(start: str) -> dict[str, set[str]]:
  """Every geoparam module `import start` runs, directly or through others, with the packages
  above each (`geoparam/__init__.py` first): `{module: imports}`."""
  seen, todo = {}, [start]
  while todo:
    module = todo.pop()
    path = _file(module)
    if module in seen or path is None:
      continue
    seen[module] = _imports(path)
    parts = module.split('.')
    todo.extend('.'.join(parts[:k]) for k in range(1, len(parts)))
    todo.extend(m for m in seen[module] if _within(m, 'geoparam'))
  return seen


def test_nothing_the_nnx_shell_imports_imports_flax_linen():
  reached = _reachable('geoparam.nnx')
  assert 'geoparam.nnx.modules' in reached and 'geoparam.exact' in reached
  bad = {m: sorted(i for i in imports if i.startswith('flax.linen') or i == 'flax.linen')
         for m, imports in reached.items()}
  assert not {m: i for m, i in bad.items() if i}, bad
  assert not any('geoparam.linen.wrappers' in i or 'geoparam.linen.transform' in i
                 for i in reached.values())


def test_nothing_the_nnx_shell_imports_imports_the_linen_shell():
  """`import geoparam.nnx` runs the package root first: neither imports `geoparam.linen` (the
  root's `__getattr__` imports it by name, on the first use of a linen name: the next test)."""
  reached = _reachable('geoparam.nnx')
  assert {'geoparam', 'geoparam.nnx', 'geoparam.nnx.transform', 'geoparam.methods'} <= set(reached)
  bad = {m: sorted(i for i in imports if _within(i, 'geoparam.linen') or _within(i, 'flax.linen'))
         for m, imports in reached.items()}
  assert not {m: i for m, i in bad.items() if i}, bad


def test_import_geoparam_nnx_loads_no_linen_module():
  """In a fresh interpreter: `import geoparam.nnx` loads no `geoparam.linen*` module; the first
  use of a linen name of `geoparam` loads the linen shell, and every name of `__all__` is there."""
  code = '''if True:
    import json, sys
    import geoparam.nnx
    out = {'nnx': sorted(m for m in sys.modules if m.startswith('geoparam.linen'))}
    import geoparam
    out['dir'] = sorted(set(geoparam.__all__) - set(dir(geoparam)))
    out['module'] = geoparam.GmPDense.__module__
    out['missing'] = [n for n in geoparam.__all__ if not hasattr(geoparam, n)]
    out['missing'] += [n for n in geoparam.nnx.__all__ if not hasattr(geoparam.nnx, n)]
    out['linen'] = sorted(m for m in sys.modules if m.startswith('geoparam.linen'))
    out['old'] = sorted(m for m in sys.modules if m in %r)
    print(json.dumps(out))
  ''' % (OLD_PATHS,)
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join(
      [str(ROOT.parent)] + [p for p in [os.environ.get('PYTHONPATH')] if p])}
  run = subprocess.run([sys.executable, '-c', code], cwd=ROOT.parent, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.splitlines()[-1])
  assert out['nnx'] == [], out
  assert out['dir'] == [] and out['missing'] == [], out
  assert out['module'] == 'geoparam.linen.layers', out
  assert {'geoparam.linen', 'geoparam.linen.layers', 'geoparam.linen.transform',
          'geoparam.linen.variance', 'geoparam.linen.wrappers'} <= set(out['linen']), out
  assert out['old'] == [], out


def test_the_moved_modules_left_nothing_at_their_old_paths():
  assert [name for name in OLD_PATHS if _file(name) is not None] == []


def test_the_core_and_the_study_tools_import_neither_shell():
  """Every module outside the two shells' folders (the package root aside, which imports the
  linen shell on first use only) imports neither `geoparam.linen` nor `geoparam.nnx`."""
  paths = [p for p in ROOT.rglob('*.py') if p.relative_to(ROOT).parts[0] not in ('linen', 'nnx')
           and p != ROOT / '__init__.py']
  names = {p.relative_to(ROOT).parts[0].removesuffix('.py') for p in paths}
  assert set(CORE + STUDY_TOOLS) <= names, set(CORE + STUDY_TOOLS) - names
  shells = ('geoparam.linen', 'geoparam.nnx', 'flax.linen', 'flax.nnx')
  bad = {str(p.relative_to(ROOT)): sorted(i for i in _imports(p)
                                          if any(_within(i, s) for s in shells)) for p in paths}
  assert not {p: i for p, i in bad.items() if i}, bad


def test_each_shell_is_one_folder():
  """Every module of geoparam/ that imports `flax.linen` is in geoparam/linen/, every one that
  imports `flax.nnx` in geoparam/nnx/ (no exception is needed: the study tools take arrays and
  parameter trees, not models)."""
  folders = {'flax.linen': 'linen', 'flax.nnx': 'nnx'}
  outside = {}
  for path in ROOT.rglob('*.py'):
    rel = path.relative_to(ROOT)
    for framework, folder in folders.items():
      if rel.parts[0] != folder and any(_within(i, framework) for i in _imports(path)):
        outside.setdefault(framework, []).append(str(rel))
  assert not outside, outside
  for folder in folders.values():  # and each folder is a shell of its framework
    assert any(_within(i, f'flax.{folder}') for p in (ROOT / folder).glob('*.py')
               for i in _imports(p)), folder


def test_methods_and_kinds_import_no_flax_framework():
  for path in list((ROOT / 'methods').glob('*.py')) + [ROOT / 'kinds.py', ROOT / 'exact.py',
                                                         ROOT / 'selection.py', ROOT / 'conv.py']:
    flax = {i for i in _imports(path) if i.startswith('flax') and not i.startswith('flax.core')}
    assert not flax, (path.name, flax)


def test_the_argument_checks_are_the_ground_floor():
  """`geoparam.checks` imports no other geoparam module: any module may import it."""
  assert not [i for i in _imports(ROOT / 'checks.py') if _within(i, 'geoparam')]
