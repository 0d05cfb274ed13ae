"""Sphinx configuration of geoparam's documentation site.

Build (from the repository root, with the `docs` extra installed):

  python -m sphinx -W --keep-going -b html docs docs/_build/html

Markdown pages (MyST) and the notebooks of `colabs/` (rendered, not executed:
tests/test_colabs.py executes them) are the guides; the API reference is generated
from the docstrings by autosummary over the public lists of names (`__all__` of
`geoparam`, `geoparam.linen`, `geoparam.nnx`, `geoparam.methods` and of every public
submodule they name), so it follows the modules as they change. A public name without a
docstring and a broken cross-reference are warnings, and `-W` makes them errors.
"""

import inspect
import importlib
import os
import re
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
sys.path.insert(0, ROOT)

project = 'geoparam'
author = 'The geoparam authors'
copyright = '2026, The geoparam authors'  # pylint: disable=redefined-builtin

extensions = [
    'myst_nb',  # Markdown pages and notebooks (it loads myst_parser)
    'sphinx.ext.autodoc',
    'sphinx.ext.autosummary',
    'sphinx.ext.napoleon',
    'sphinx.ext.mathjax',
    'sphinx_copybutton',
]

# .rst first: autosummary writes its stub pages with the first suffix.
source_suffix = {'.rst': 'restructuredtext', '.md': 'myst-nb', '.ipynb': 'myst-nb'}
exclude_patterns = ['_build', 'results/**', 'README.md', '**/.ipynb_checkpoints']
root_doc = 'index'

# The notebooks are committed without outputs and executed by the test suite.
nb_execution_mode = 'off'
myst_enable_extensions = ['dollarmath', 'colon_fence']
myst_heading_anchors = 3

# Every cross-reference must resolve; references into other projects' APIs (type
# hints such as jax.Array) have no target here without intersphinx, which would need
# the network at build time.
nitpicky = True
nitpick_ignore_regex = [
    (r'py:.*', r'(jax|jaxlib|flax|optax|numpy|np|jnp|nn|nnx|chex|typing|collections|abc|'
               r'functools|dataclasses|enum|types|builtins|ml_collections)(\..*)?'),
    (r'py:.*', r'[A-Za-z_]+'),  # bare names in signatures: int, Array, Callable, PRNGKey, ...
    # Returned by the public schedules but not exported itself (a NamedTuple of init, update).
    ('py:class', 'geoparam.schedules.Schedule'),
]

autosummary_generate = False  # the API pages list every entry themselves (write_api_pages)
autosummary_ignore_module_all = False
autodoc_default_options = {'members': False}
autodoc_typehints = 'signature'
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
add_module_names = False

copybutton_prompt_text = r'>>> |\.\.\. |\$ '
copybutton_prompt_is_regexp = True

html_theme = 'sphinx_book_theme'
html_title = 'geoparam'
html_static_path = ['_static']
html_css_files = ['custom.css']
html_theme_options = {
    'repository_url': 'https://github.com/YOUR-ORG/geoparam',
    'use_repository_button': True,
    'show_toc_level': 2,
}

# ---------------------------------------------------------------------------
# The API reference: one page per public module, generated here from `__all__`.

API_ROOTS = ('geoparam', 'geoparam.linen', 'geoparam.nnx', 'geoparam.methods',
             'geoparam.methods.run')
API_DIR = os.path.join(DOCS, 'api')


def public_modules():
  """{module name: [its public non-module names]}, from the roots and every module their
  `__all__` names (in order of discovery)."""
  found, queue = {}, list(API_ROOTS)
  while queue:
    name = queue.pop(0)
    if name in found:
      continue
    module = importlib.import_module(name)
    names = list(getattr(module, '__all__', None) or [])
    if not names:
      raise RuntimeError(f'{name} has no __all__: the API reference lists the names of __all__.')
    found[name] = []
    for attr in names:
      obj = getattr(module, attr)
      if inspect.ismodule(obj):
        if obj.__name__.startswith('geoparam'):
          queue.append(obj.__name__)
      else:
        found[name].append(attr)
  return found


def directive(module, attr):
  """The autodoc directive of `module.attr`, by what it is."""
  obj = getattr(importlib.import_module(module), attr)
  if inspect.isclass(obj):
    return [f'.. autoclass:: {attr}', '   :members:', '   :special-members: __call__', '']
  if callable(obj):
    return [f'.. autofunction:: {attr}', '']
  return [f'.. autodata:: {attr}', '   :no-value:', '']


def write_api_pages():
  """docs/api/<module>.rst for every public module (regenerated at each build; ignored by git):
  the module's docstring, a summary table of its names, then each name's entry on the same page
  (one page per module keeps the build fast: the theme's navigation costs per page)."""
  os.makedirs(API_DIR, exist_ok=True)
  modules = public_modules()
  pages = {}
  for name, attrs in modules.items():
    submodules = [m for m in modules if m.startswith(name + '.') and '.' not in m[len(name) + 1:]]
    lines = [name, '=' * len(name), '', f'.. automodule:: {name}', '   :no-members:', '',
             f'.. currentmodule:: {name}', '']
    if attrs:
      lines += ['.. autosummary::', '   :nosignatures:', '']
      lines += [f'   {a}' for a in attrs] + ['']
    if submodules:
      lines += ['Submodules', '----------', '', '.. toctree::', '   :maxdepth: 1', '']
      lines += [f'   {m}' for m in submodules] + ['']
    if attrs:
      lines += ['Reference', '---------', '']
      for attr in attrs:
        lines += directive(name, attr)
    pages[name] = '\n'.join(lines)
  for name, text in pages.items():
    path = os.path.join(API_DIR, f'{name}.rst')
    old = open(path).read() if os.path.exists(path) else None
    if old != text:  # unchanged pages keep their time stamps: incremental builds stay fast
      with open(path, 'w') as f:
        f.write(text)
  for stale in os.listdir(API_DIR):
    if stale.endswith('.rst') and stale[:-4] not in pages:
      os.remove(os.path.join(API_DIR, stale))
  return list(pages)


# (tests/test_docs_build.py borrows this configuration for small builds without the API pages)
API_PAGES = [] if os.environ.get('GEOPARAM_DOCS_NO_API') else write_api_pages()


LITERAL = re.compile(r'(?<![`:\w])`([^`]+)`(?![`_\w])')


def rst_safe(lines):
  """The docstrings are Google style with Markdown habits; make them valid reStructuredText
  without changing what they say: `code` spans become literals, a `|` outside them is
  escaped (not a substitution), and an indented block of uneven indentation (a table or a
  formula laid out by hand) becomes a literal block."""
  rule = re.compile(r'\s*=+(\s+=+)+\s*')
  indent = lambda l: len(l) - len(l.lstrip())
  # Left as they are: tables (a block holding a rule line), literal blocks (after '::') and
  # doctest blocks (from '>>>' to the next blank line).
  keep, k = set(), 0
  while k < len(lines):
    j = k
    while j < len(lines) and lines[j].strip():
      j += 1
    block = lines[k:j]
    if any(rule.fullmatch(l) for l in block) or (block and block[0].lstrip().startswith('>>>')):
      keep.update(range(k, j))
    if block and block[-1].rstrip().endswith('::'):
      base, m = indent(block[-1]), j
      while m < len(lines) and (not lines[m].strip() or indent(lines[m]) > base):
        keep.add(m)
        m += 1
      j = m - 1
    k = j + 1
  out = []
  for n, line in enumerate(lines):
    if n in keep:
      out.append(line)
      continue
    pieces = re.split(r'(``.*?``|:\w+:`[^`]*`)', line)
    for i in range(0, len(pieces), 2):
      # (an ellipsis, not '. ': autosummary ends a summary at a period and a space)
      piece = LITERAL.sub(lambda m: '``' + m.group(1).replace('... ', '\u2026 ') + '``', pieces[i])
      pieces[i] = re.sub(r'(?<!`)\|(?!`)', r'\\|', piece) if '``' not in piece else '``'.join(
          re.sub(r'(?<!\\)\|', r'\\|', p) if j % 2 == 0 else p
          for j, p in enumerate(piece.split('``')))
    out.append(''.join(pieces))
  lines[:] = out
  i, result = 0, []
  while i < len(lines):
    line = lines[i]
    prev = next((l for l in reversed(result) if l.strip()), '')
    starts_run = line.strip() and (not result or not result[-1].strip()) and indent(line) > indent(prev)
    if starts_run and not prev.rstrip().endswith('::') and not prev.lstrip().startswith('.. '):
      j = i
      while j < len(lines) and lines[j].strip():
        j += 1
      run = lines[i:j]
      if (any(indent(l) > indent(run[0]) for l in run[1:]) and
          not re.match(r'\s*([-*+] |\d+[.)] |:|>>>|\.\. )', run[0])):
        result += [' ' * indent(prev) + '::', '']
    result.append(line)
    i += 1
  lines[:] = result


def comment_above(obj_module, name):
  """The `#` comment lines right above `name = ...` / `name: ... = ...` in the module's source."""
  try:
    source = inspect.getsource(sys.modules[obj_module]).splitlines()
  except (KeyError, OSError, TypeError):
    return []
  for k, line in enumerate(source):
    if re.match(rf'{re.escape(name)}\s*[:=]', line):
      comments = []
      while k > 0 and source[k - 1].lstrip().startswith('#'):
        k -= 1
        comments.insert(0, source[k].lstrip()[1:].strip())
      return comments
  return []


def process_docstring(app, what, name, obj, options, lines):
  """A public name without a docstring is a warning (an error under -W); data take the
  comment above their assignment (not their type's docstring); see `rst_safe`."""
  del app, options
  if what in ('data', 'attribute') and not inspect.isroutine(obj):
    if lines and type(obj).__doc__ and ' '.join(lines).split() == ' '.join(
        inspect.cleandoc(type(obj).__doc__).splitlines()).split():
      module, _, attr = name.rpartition('.')
      lines[:] = [re.sub(r'(?<!`)\*', r'\\*', l) for l in comment_above(module, attr)]
  # A NamedTuple without a docstring has one made of its field names: that is none either.
  fields = getattr(obj, '_fields', None) if what == 'class' else None
  generated = isinstance(fields, tuple) and ' '.join(lines).strip() == (
      f'{obj.__name__}({", ".join(fields)})')
  if what in ('module', 'class', 'function', 'exception') and (
      generated or not any(l.strip() for l in lines)):
    from sphinx.util import logging  # pylint: disable=g-import-not-at-top
    logging.getLogger('geoparam.docs').warning(f'{what} {name} has no docstring')
  rst_safe(lines)


def setup(app):
  # Before napoleon (priority 500) reads the Google-style sections.
  app.connect('autodoc-process-docstring', process_docstring, priority=400)
