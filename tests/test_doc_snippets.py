"""Every ```python block of README.md and of the documentation pages (docs/*.md) runs as
pasted, and prints what the page shows.

The blocks are doctests (`>>>` prompts, outputs checked with ELLIPSIS and
NORMALIZE_WHITESPACE, as the library's docstrings). Each runs in a fresh namespace,
except a block whose preceding paragraph says it is "Continuing" the example
before it on the same page: it runs in that example's namespace. Method registrations a block
makes are undone afterwards, so the rest of the suite sees the registry it expects.

IPython and Jupyter strip the prompts of a pasted block but keep its output lines
as code, so each block must also run that way: it must compile after IPython's
transform, and each shown output must be an expression of literals and builtins
(`True`, tuples, dicts, `ValueError('...')`; not a traceback, not `Array(...)`:
show an error with `print(repr(e))`).
"""

import builtins
import doctest
import glob
import os
import re

from IPython.core.inputtransformer2 import TransformerManager

import pytest

from geoparam import methods

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


PAGES = ['README.md'] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'docs', '*.md')))


def python_blocks(text: str, page: str = 'README.md') -> list[list[tuple[str, str]]]:
  """The ```python blocks as `('page:line', source)`, grouped: a group is a block and those
  continuing it."""
  groups = []
  for m in re.finditer(r'^```python\n(.*?)^```', text, flags=re.S | re.M):
    line = text.count('\n', 0, m.start()) + 2  # the block's first line, 1-based
    where = f'{page}:{line}'
    paragraph = text[:m.start()].rstrip('\n').split('\n\n')[-1]
    if re.search(r'\bcontinuing\b', paragraph, flags=re.I):
      assert groups, f'{where}: the first python block of a page cannot continue another'
      groups[-1].append((where, m.group(1)))
    else:
      groups.append([(where, m.group(1))])
  return groups


GROUPS = []
for _page in PAGES:
  with open(os.path.join(ROOT, _page), encoding='utf-8') as f:
    GROUPS += python_blocks(f.read(), _page)


def check_pastable(where: str, source: str, examples: list[doctest.Example]) -> None:
  """Fails unless `source` runs as IPython runs it pasted (prompts stripped, outputs kept)."""
  try:
    compile(TransformerManager().transform_cell(source), where, 'exec')
  except SyntaxError as e:
    raise AssertionError(f'{where}: pasted into IPython it is not Python: {e}') from e
  for example in examples:
    try:
      names = set(compile(example.want, 'output', 'eval').co_names)
    except SyntaxError:
      names = {'(not an expression)'}
    if example.want and names - set(dir(builtins)):
      raise AssertionError(f'{where} (+{example.lineno}): the output {example.want!r} '
                           f'fails when pasted into IPython (it names {sorted(names)}).')


def run_group(group: list[tuple[str, str]]) -> None:
  """Runs the blocks of one group as doctests in one namespace; fails with doctest's report."""
  parser, globs = doctest.DocTestParser(), {'__name__': 'readme'}
  registry = dict(methods.REGISTRY)
  try:
    for where, source in group:
      page, line = where.rsplit(':', 1)
      test = parser.get_doctest(source, globs, where, page, int(line) - 1)
      assert test.examples, f'{where}: write the python block as a doctest (>>> prompts)'
      check_pastable(where, source, test.examples)
      report = []
      runner = doctest.DocTestRunner(optionflags=FLAGS)
      result = runner.run(test, out=report.append, clear_globs=False)
      assert result.failed == 0, ''.join(report)
      globs = test.globs  # (get_doctest copies it) the next block of the group continues here
  finally:
    methods.REGISTRY.clear()
    methods.REGISTRY.update(registry)


def test_the_pages_have_python_blocks():
  pages = {g[0][0].split(':')[0] for g in GROUPS}
  assert {'README.md', 'docs/index.md', 'docs/library.md', 'docs/reparameterize.md'} <= pages, pages
  assert sum(map(len, GROUPS)) >= 7 and any(len(g) > 1 for g in GROUPS), GROUPS


@pytest.mark.parametrize('group', GROUPS, ids=[g[0][0] for g in GROUPS])
def test_python_blocks_run(group):
  run_group(group)


def test_a_wrong_output_fails():
  """The check can fail: a block whose shown output is wrong, and one that raises."""
  with pytest.raises(AssertionError, match='Expected'):
    run_group([('t.md:1', '>>> 1 + 1\n3\n')])
  with pytest.raises(AssertionError, match='ZeroDivisionError'):
    run_group([('t.md:1', '>>> x = 1 / 0\n')])
  with pytest.raises(AssertionError, match='doctest'):
    run_group([('t.md:1', 'x = 1\n')])
  with pytest.raises(AssertionError, match='IPython'):
    run_group([('t.md:1', '>>> 1 / 0\nTraceback (most recent call last):\nZeroDivisionError: ...\n')])
  with pytest.raises(AssertionError, match='IPython'):
    run_group([('t.md:1', '>>> import numpy as np\n>>> np.zeros(1)\narray([0.])\n')])
