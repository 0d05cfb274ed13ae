"""Copies the repository URL of pyproject.toml into the notebooks and colabs/README.md.

The one place the repository's public location is written is `[project.urls] Repository` in
`pyproject.toml`. Colab opens a notebook with nothing else of the repository at hand, so each
notebook's setup cell holds a copy (`REPO_URL = '...'`), as do the "Open in Colab" links of
`colabs/README.md`. After changing the URL in pyproject.toml run

  python colabs/sync_repo_url.py            # rewrites the copies
  python colabs/sync_repo_url.py --check    # exit status 1 and the stale files, changes nothing

`tests/test_colabs.py` runs the check.
"""

from __future__ import annotations

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLABS = os.path.join(ROOT, 'colabs')
_URL_LINE = re.compile(r"^(REPO_URL = )'[^']*'", re.MULTILINE)
_COLAB_LINK = re.compile(r'https://colab\.research\.google\.com/github/[^/\s)]+/[^/\s)]+/')


def repo_url(pyproject: str = os.path.join(ROOT, 'pyproject.toml')) -> str:
  """`[project.urls] Repository` of pyproject.toml (`https://github.com/OWNER/NAME`)."""
  with open(pyproject, encoding='utf-8') as f:
    text = f.read()
  section = re.search(r'^\[project\.urls\]\s*$(.*?)(?=^\[|\Z)', text,
                      re.MULTILINE | re.DOTALL)
  match = section and re.search(r'^Repository\s*=\s*"([^"]+)"', section.group(1),
                                re.MULTILINE)
  if not match:
    raise ValueError(f'{pyproject}: no Repository = "..." line under [project.urls].')
  url = match.group(1).rstrip('/')
  if not re.fullmatch(r'https://github\.com/[^/\s]+/[^/\s]+', url):
    raise ValueError(f'{pyproject}: Repository = {url!r} is not https://github.com/OWNER/NAME '
                     '(Colab opens notebooks from GitHub).')
  return url


def _synced_notebook(text: str, url: str) -> str:
  nb = json.loads(text)
  for cell in nb['cells']:
    if cell['cell_type'] == 'code':
      source = ''.join(cell['source'])
      new = _URL_LINE.sub(lambda m: f"{m.group(1)}'{url}'", source, count=1)
      if new != source:
        cell['source'] = new.splitlines(keepends=True)
      break  # the first code cell only
  return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + '\n'  # as nbformat


def _synced_readme(text: str, url: str) -> str:
  owner_name = url[len('https://github.com/'):]
  return _COLAB_LINK.sub(f'https://colab.research.google.com/github/{owner_name}/', text)


def stale_files(url: str | None = None, write: bool = False) -> list[str]:
  """Files whose copy of the URL differs from pyproject.toml's; rewritten when `write`."""
  url = url or repo_url()
  stale = []
  names = sorted(n for n in os.listdir(COLABS) if n.endswith('.ipynb')) + ['README.md']
  for name in names:
    path = os.path.join(COLABS, name)
    with open(path, encoding='utf-8') as f:
      text = f.read()
    sync = _synced_readme if name == 'README.md' else _synced_notebook
    new = sync(text, url)
    changed = (json.loads(new) != json.loads(text)) if name.endswith('.ipynb') else new != text
    if changed:
      stale.append(os.path.relpath(path, ROOT))
      if write:
        with open(path, 'w', encoding='utf-8') as f:
          f.write(new)
  return stale


def main(argv):
  check = '--check' in argv[1:]
  if set(argv[1:]) - {'--check'}:
    raise SystemExit(f'usage: python colabs/sync_repo_url.py [--check]; got {argv[1:]}')
  url = repo_url()
  stale = stale_files(url, write=not check)
  verb = 'differ from' if check else 'updated to'
  for path in stale:
    print(f'{path}: {verb} {url}')
  if not stale:
    print(f'all copies are {url}')
  return 1 if check and stale else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
