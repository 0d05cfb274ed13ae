"""The library's shape: the core and the NNX shell import no linen; the methods no Flax framework."""

import ast
import pathlib

import geoparam

ROOT = pathlib.Path(geoparam.__file__).parent


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


def _file(module: str) -> pathlib.Path | None:
  rel = pathlib.Path(*module.split('.')[1:])
  for candidate in (ROOT / rel.with_suffix('.py'), ROOT / rel / '__init__.py'):
    if candidate.exists():
      return candidate
  return None


def _reachable(start: str) -> dict[str, set[str]]:
  """Every geoparam module `start` imports, directly or through others: `{module: imports}`."""
  seen, todo = {}, [start]
  while todo:
    module = todo.pop()
    path = _file(module)
    if module in seen or path is None:
      continue
    seen[module] = _imports(path)
    todo.extend(m for m in seen[module] if m.startswith('geoparam.'))
  return seen


def test_nothing_the_nnx_shell_imports_imports_flax_linen():
  reached = _reachable('geoparam.nnx')
  assert 'geoparam.nnx.modules' in reached and 'geoparam.exact' in reached
  bad = {m: sorted(i for i in imports if i.startswith('flax.linen') or i == 'flax.linen')
         for m, imports in reached.items()}
  assert not {m: i for m, i in bad.items() if i}, bad
  assert not any('geoparam.linen.wrappers' in i or 'geoparam.linen.transform' in i
                 for i in reached.values())


def test_methods_and_kinds_import_no_flax_framework():
  for path in list((ROOT / 'methods').glob('*.py')) + [ROOT / 'kinds.py', ROOT / 'exact.py',
                                                         ROOT / 'selection.py', ROOT / 'conv.py']:
    flax = {i for i in _imports(path) if i.startswith('flax') and not i.startswith('flax.core')}
    assert not flax, (path.name, flax)
