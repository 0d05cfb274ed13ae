"""Every ```python block of README.md runs as pasted, and prints what the README shows.

The blocks are doctests (`>>>` prompts, outputs checked with ELLIPSIS and
NORMALIZE_WHITESPACE, as the library's docstrings). Each runs in a fresh namespace,
except a block whose preceding paragraph says it is "Continuing" the example
before it: it runs in that example's namespace. Method registrations a block
makes are undone afterwards, so the rest of the suite sees the registry it expects.

IPython and Jupyter strip the prompts of a pasted block but keep its output lines
as code, so each block must also run that way: it must compile after IPython's
transform, and each shown output must be an expression of literals and builtins
(`True`, tuples, dicts, `ValueError('...')`; not a traceback, not `Array(...)`:
show an error with `print(repr(e))`).
"""

import builtins
import doctest
import os
import re

from IPython.core.inputtransformer2 import TransformerManager

import pytest

from geoparam import methods

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def readme_python_blocks(text: str) -> list[list[tuple[int, str]]]:
  """The ```python blocks as `(line, source)`, grouped: a group is a block and those continuing it."""
  groups = []
  for m in re.finditer(r'^```python\n(.*?)^```', text, flags=re.S | re.M):
    line = text.count('\n', 0, m.start()) + 2  # the block's first line, 1-based
    paragraph = text[:m.start()].rstrip('\n').split('\n\n')[-1]
    if re.search(r'\bcontinuing\b', paragraph, flags=re.I):
      assert groups, f'README.md:{line}: the first python block cannot continue another'
      groups[-1].append((line, m.group(1)))
    else:
      groups.append([(line, m.group(1))])
  return groups


with open(os.path.join(ROOT, 'README.md')) as f:
  GROUPS = readme_python_blocks(f.read())


def check_pastable(line: int, source: str, examples: list[doctest.Example]) -> None:
  """Fails unless `source` runs as IPython runs it pasted (prompts stripped, outputs kept)."""
  try:
    compile(TransformerManager().transform_cell(source), f'README.md:{line}', 'exec')
  except SyntaxError as e:
    raise AssertionError(f'README.md:{line}: pasted into IPython it is not Python: {e}') from e
  for example in examples:
    try:
      names = set(compile(example.want, 'output', 'eval').co_names)
    except SyntaxError:
      names = {'(not an expression)'}
    if example.want and names - set(dir(builtins)):
      raise AssertionError(f'README.md:{line + example.lineno}: the output {example.want!r} '
                           f'fails when pasted into IPython (it names {sorted(names)}).')


def run_group(group: list[tuple[int, str]]) -> None:
  """Runs the blocks of one group as doctests in one namespace; fails with doctest's report."""
  parser, globs = doctest.DocTestParser(), {'__name__': 'readme'}
  registry = dict(methods.REGISTRY)
  try:
    for line, source in group:
      test = parser.get_doctest(source, globs, f'README.md:{line}', 'README.md', line - 1)
      assert test.examples, f'README.md:{line}: write the python block as a doctest (>>> prompts)'
      check_pastable(line, source, test.examples)
      report = []
      runner = doctest.DocTestRunner(optionflags=FLAGS)
      result = runner.run(test, out=report.append, clear_globs=False)
      assert result.failed == 0, ''.join(report)
      globs = test.globs  # (get_doctest copies it) the next block of the group continues here
  finally:
    methods.REGISTRY.clear()
    methods.REGISTRY.update(registry)


def test_the_readme_has_python_blocks():
  assert sum(map(len, GROUPS)) >= 5 and any(len(g) > 1 for g in GROUPS), GROUPS


@pytest.mark.parametrize('group', GROUPS, ids=[f'line{g[0][0]}' for g in GROUPS])
def test_readme_python_blocks_run(group):
  run_group(group)


def test_a_wrong_output_fails():
  """The check can fail: a block whose shown output is wrong, and one that raises."""
  with pytest.raises(AssertionError, match='Expected'):
    run_group([(1, '>>> 1 + 1\n3\n')])
  with pytest.raises(AssertionError, match='ZeroDivisionError'):
    run_group([(1, '>>> x = 1 / 0\n')])
  with pytest.raises(AssertionError, match='doctest'):
    run_group([(1, 'x = 1\n')])
  with pytest.raises(AssertionError, match='IPython'):
    run_group([(1, '>>> 1 / 0\nTraceback (most recent call last):\nZeroDivisionError: ...\n')])
  with pytest.raises(AssertionError, match='IPython'):
    run_group([(1, '>>> import numpy as np\n>>> np.zeros(1)\narray([0.])\n')])
