"""Fetching data files (experiments.data.download and the loaders' `download=True`).

Every fetch goes to an HTTP server on 127.0.0.1 (port 0) started here, serving
the shared data folder as the mirror `<server>/data/<path>`, and the same files
damaged on purpose under other prefixes: `/corrupt/` (one byte changed),
`/truncated/` (the full Content-Length announced, half the body sent, then the
connection closed), `/short/` (a complete response of half the file). Nothing
is fetched from any other address, and the cache is always a temporary folder.
"""

import dataclasses
import hashlib
import http.server
import io
import os
import socket
import tarfile
import threading
from typing import ClassVar

import numpy as np
import pytest

from experiments.studies import banana_2d
from experiments.data import download, uci_data
from experiments.vision import sources
from tests import cli_fork

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.environ.get('GEOPARAM_DATA_DIR') or os.path.join(ROOT, '..', 'shared', 'data')
needs_data = pytest.mark.skipif(
    not os.path.isfile(os.path.join(DATA_DIR, 'banana.csv')),
    reason=f'shared data not found in {DATA_DIR} (set GEOPARAM_DATA_DIR)')


class _Handler(http.server.BaseHTTPRequestHandler):
  """GET /<mode>/<path>: the file <roots[root]>/<path>, served as <mode> says."""

  roots: ClassVar[dict] = {}
  requests: ClassVar[list] = []

  def log_message(self, *args):  # quiet
    pass

  def do_GET(self):
    type(self).requests.append(self.path)
    mode, _, rel = self.path.lstrip('/').partition('/')
    root = self.roots.get('extra' if mode == 'extra' else 'data')
    path = os.path.realpath(os.path.join(root, rel))
    if mode not in ('data', 'extra', 'corrupt', 'truncated', 'short') or not os.path.isfile(path):
      self.send_error(404)
      return
    with open(path, 'rb') as f:
      body = f.read()
    length = len(body)
    if mode == 'corrupt':
      body = body[:100] + bytes([body[100] ^ 1]) + body[101:]
    elif mode == 'short':
      body = body[:len(body) // 2]
      length = len(body)
    elif mode == 'truncated':
      body = body[:len(body) // 2]
    self.send_response(200)
    self.send_header('Content-Length', str(length))
    self.end_headers()
    self.wfile.write(body)
    if mode == 'truncated':
      self.wfile.flush()
      self.close_connection = True


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  """(base URL, request log, folder served under /extra/) of the loopback server."""
  extra = tmp_path_factory.mktemp('served')
  handler = type('Handler', (_Handler,), {'roots': {'data': os.path.realpath(DATA_DIR),
                                                    'extra': str(extra)}, 'requests': []})
  httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  yield f'http://127.0.0.1:{httpd.server_address[1]}', handler.requests, extra
  httpd.shutdown()
  httpd.server_close()


@pytest.fixture(autouse=True)
def _no_ambient_data(monkeypatch):
  """No data folder or mirror from the environment: each test says what it uses."""
  for var in (download.DATA_DIR_ENV, download.BASE_URL_ENV, download.CACHE_DIR_ENV):
    monkeypatch.delenv(var, raising=False)


def _files(folder):
  return sorted(os.path.relpath(os.path.join(d, f), folder)
                for d, _, files in os.walk(folder) for f in files)


@needs_data
def test_registry_matches_the_reference_copies():
  """Every REMOTES entry present in the shared data folder has its size and sha256."""
  checked = 0
  for path, remote in download.REMOTES.items():
    local = os.path.join(DATA_DIR, *path.split('/'))
    if os.path.isfile(local):
      assert (os.path.getsize(local), download.sha256_of(local)) == (remote.size, remote.sha256)
      checked += 1
  assert checked == 8  # banana, six UCI files, the CIFAR-10 JPEG archive


@needs_data
@pytest.mark.parametrize('path', ['banana.csv', 'uci/yacht.txt'])
def test_fetch_verifies_and_caches(server, tmp_path, path):
  base, requests, _ = server
  cache = str(tmp_path / 'cache')
  got = download.find(path, None, download=True, cache_dir=cache, base_url=f'{base}/data')
  assert got == os.path.join(download.cache_root(cache), *path.split('/'))
  with open(got, 'rb') as f, open(os.path.join(DATA_DIR, path), 'rb') as g:
    assert f.read() == g.read()
  assert _files(download.cache_root(cache)) == [os.path.join(*path.split('/'))]  # no temp files
  umask = os.umask(0)
  os.umask(umask)
  assert os.stat(got).st_mode & 0o777 == 0o666 & ~umask  # readable like any file, not 0600
  n = len(requests)
  again = download.find(path, None, download=True, cache_dir=cache, base_url=f'{base}/data')
  assert again == got and len(requests) == n  # the cached copy, no second request
  # A data directory holding the file wins over the cache, and needs no download.
  assert download.find(path, DATA_DIR) == os.path.join(DATA_DIR, *path.split('/'))
  assert len(requests) == n


def test_without_download_nothing_is_fetched(server, tmp_path, monkeypatch):
  base, requests, _ = server
  monkeypatch.setenv(download.BASE_URL_ENV, f'{base}/data')
  n = len(requests)
  with pytest.raises(FileNotFoundError, match=r'banana.csv not found \(no --config.data_dir and no '
                     r'\$GEOPARAM_DATA_DIR\).*\(--config.download=True; download=True in Python\)'):
    download.find('banana.csv', None, cache_dir=str(tmp_path))
  with pytest.raises(FileNotFoundError,
                     match=r"--config.data_dir='.*empty'.*GEOPARAM_DATA_DIR=DIR"):
    download.find('banana.csv', str(tmp_path / 'empty'), cache_dir=str(tmp_path))
  assert len(requests) == n and _files(tmp_path) == []


@needs_data
def test_wrong_checksum_keeps_nothing(server, tmp_path):
  base, _, _ = server
  cache = str(tmp_path)
  with pytest.raises(download.DownloadError, match=(
      r'uci/concrete.txt from http://127.0.0.1:\d+/corrupt/uci/concrete.txt does not match its '
      r'checksum: got 57858 bytes with sha256 [0-9a-f]{64}, expected 57858 bytes with sha256 '
      + download.REMOTES['uci/concrete.txt'].sha256)):
    download.fetch('uci/concrete.txt', cache, f'{base}/corrupt')
  assert _files(cache) == []
  # A good copy fetched earlier survives a later bad fetch.
  good = download.fetch('uci/concrete.txt', cache, f'{base}/data')
  with pytest.raises(download.DownloadError, match='does not match its checksum'):
    download.fetch('uci/concrete.txt', cache, f'{base}/corrupt')
  assert _files(cache) == [os.path.join('data', 'uci', 'concrete.txt')]
  assert download.sha256_of(good) == download.REMOTES['uci/concrete.txt'].sha256


@needs_data
def test_truncated_download_keeps_nothing(server, tmp_path):
  base, _, _ = server
  with pytest.raises(download.DownloadError,
                     match=r'truncated download of uci/power.txt .*: 154340 of 308680 bytes'):
    download.fetch('uci/power.txt', str(tmp_path), f'{base}/truncated')
  assert _files(tmp_path) == []
  # A complete response of the wrong length (e.g. a changed file) fails the size check.
  with pytest.raises(download.DownloadError, match='got 154340 bytes with sha256'):
    download.fetch('uci/power.txt', str(tmp_path), f'{base}/short')
  assert _files(tmp_path) == []


def test_offline_error_names_the_url_and_what_to_do(tmp_path):
  with socket.socket() as s:  # a loopback port with nobody listening
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  url = f'http://127.0.0.1:{port}/m'
  with pytest.raises(download.DownloadError) as info:
    download.find('uci/yacht.txt', None, download=True, cache_dir=str(tmp_path), base_url=url)
  msg = str(info.value)
  assert f'could not download uci/yacht.txt from {url}/uci/yacht.txt' in msg
  assert 'refused' in msg.lower() and 'offline' in msg
  assert os.path.join(str(tmp_path), 'data', 'uci') in msg and 'GEOPARAM_DATA_URL' in msg
  assert _files(tmp_path) == []


def test_http_error_and_unknown_files(server, tmp_path):
  base, _, _ = server
  with pytest.raises(download.DownloadError, match='HTTP Error 404'):
    download.fetch('banana.csv', str(tmp_path), f'{base}/nothing-here')
  assert _files(tmp_path) == []
  with pytest.raises(ValueError, match="no download source for 'mnist.npz'; known files: "
                     'banana.csv, uci/boston.txt'):
    download.fetch('mnist.npz', str(tmp_path))
  with pytest.raises(download.DownloadError, match='has no public source: set GEOPARAM_DATA_URL'):
    download.url_for(sources.JPEG_ARCHIVE)
  assert download.url_for('uci/wine.txt').startswith('https://raw.githubusercontent.com/yaringal/')


@needs_data
def test_loaders_download_when_allowed(server, tmp_path):
  base, requests, _ = server
  mirror, cache = f'{base}/data', str(tmp_path)
  x, y = banana_2d.load_banana(None, download=True, cache_dir=cache, base_url=mirror)
  x_ref, y_ref = banana_2d.load_banana(DATA_DIR)
  np.testing.assert_array_equal(x, x_ref)
  np.testing.assert_array_equal(y, y_ref)
  ds = uci_data.load('energy', None, download=True, cache_dir=cache, base_url=mirror)
  np.testing.assert_array_equal(ds.x, uci_data.load('energy', DATA_DIR).x)
  assert ds.path.startswith(cache)
  assert uci_data.check_datasets(['yacht', 'power'], None, download=True) == ('yacht', 'power')
  assert uci_data.available(None, download=True) == uci_data.PAPER_DATASETS
  # Without download, the errors of a missing data directory stay, with a hint.
  n = len(requests)
  with pytest.raises(ValueError, match='GEOPARAM_DATA_DIR.*--config.download=True'):
    banana_2d.load_banana(None)
  with pytest.raises(ValueError, match='does not exist'):
    uci_data.load('yacht', str(tmp_path / 'nowhere'))
  (tmp_path / 'some' / 'uci').mkdir(parents=True)
  (tmp_path / 'some' / 'uci' / 'toy.txt').write_text('1 2\n3 4\n')
  with pytest.raises(ValueError,
                     match='no file yacht.txt.*found: toy. Pass --config.download=True'):
    uci_data.load('yacht', str(tmp_path / 'some'))
  with pytest.raises(ValueError, match=r"unknown datasets \['nope'\].*or downloadable"):
    uci_data.check_datasets(['nope'], None, download=True)
  assert len(requests) == n


@needs_data
def test_uci_regression_flag_downloads(server, tmp_path):
  """`--config.download=True` from the command line, the mirror given by $GEOPARAM_DATA_URL."""
  base, requests, _ = server
  env = {download.DATA_DIR_ENV: None, download.BASE_URL_ENV: f'{base}/data',
         download.CACHE_DIR_ENV: str(tmp_path / 'c')}
  args = ['--config=experiments/configs/uci_regression.py', '--config.datasets=yacht',
          '--config.methods=sp', '--config.num_splits=1', '--config.num_epochs=3',
          f'--workdir={tmp_path / "out"}']
  # python -m experiments.main in a forked child (tests/cli_fork.py) with that environment
  bad = cli_fork.run_main(args, env=env)
  assert bad.returncode == 2 and 'no data directory' in bad.stderr  # not without download
  assert not (tmp_path / 'out').exists()  # refused before any work
  proc = cli_fork.run_main(args + ['--config.download=True'], env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f'downloading uci/yacht.txt (0.01 MB) from {base}/data/uci/yacht.txt' in proc.stderr
  assert '/data/uci/yacht.txt' in requests
  assert os.path.isfile(tmp_path / 'c' / 'data' / 'uci' / 'yacht.txt')
  assert os.path.isfile(tmp_path / 'out' / 'results.json')


CIFAR_NAMES = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship',
               'truck')


def _cifar_binary(path, names, batches, seed=0):
  """A CIFAR-10-format binary archive; returns {split: (images (n, 32, 32, 3), labels)}."""
  rng = np.random.default_rng(seed)
  expected = {}
  with tarfile.open(path, 'w:gz') as tf:
    def add(name, data):
      info = tarfile.TarInfo(f'cifar-10-batches-bin/{name}')
      info.size = len(data)
      tf.addfile(info, io.BytesIO(data))
    add('batches.meta.txt', ('\n'.join(names) + '\n\n').encode())
    for name, n in batches:
      images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
      labels = rng.integers(0, len(names), n).astype(np.uint8)
      rows = np.concatenate([labels[:, None], images.transpose(0, 3, 1, 2).reshape(n, -1)], 1)
      add(name, rows.tobytes())
      split = 'test' if name == 'test_batch.bin' else 'train'
      old = expected.get(split, (np.zeros((0, 32, 32, 3), np.uint8), np.zeros(0, np.uint8)))
      expected[split] = (np.concatenate([old[0], images]), np.concatenate([old[1], labels]))
  return expected


def test_cifar10_binary_fetched_and_decoded(server, tmp_path, monkeypatch):
  """Without a data directory, download=True fetches the official archive (here a small one)."""
  base, requests, extra = server
  archive = extra / sources.CIFAR10_BINARY
  expected = _cifar_binary(archive, CIFAR_NAMES, [('data_batch_1.bin', 7),
                                                  ('data_batch_2.bin', 5), ('test_batch.bin', 4)])
  remote = download.REMOTES[sources.CIFAR10_BINARY]
  body = archive.read_bytes()
  monkeypatch.setitem(download.REMOTES, sources.CIFAR10_BINARY, dataclasses.replace(
      remote, url=f'{base}/extra/{sources.CIFAR10_BINARY}', size=len(body),
      sha256=hashlib.sha256(body).hexdigest()))
  cache = str(tmp_path / 'cache')
  with pytest.raises(FileNotFoundError, match='--config.download=True'):
    sources.load_jpeg_archive(None, cache)
  data, classes = sources.load_jpeg_archive(None, cache, download=True)
  assert classes == list(CIFAR_NAMES)
  for split in ('train', 'test'):
    np.testing.assert_array_equal(data[split].images, expected[split][0])
    np.testing.assert_array_equal(data[split].labels, expected[split][1])
  assert f'/extra/{sources.CIFAR10_BINARY}' in requests
  # The second load reads the decoded cache: no request, no decoding.
  n = len(requests)
  monkeypatch.setattr(sources, 'decode_cifar10_binary', lambda *_: pytest.fail('decoded twice'))
  again, _ = sources.load_jpeg_archive(None, cache, download=True)
  np.testing.assert_array_equal(again['train'].images, expected['train'][0])
  assert len(requests) == n


def test_cifar10_binary_classes_in_sorted_order(tmp_path):
  """Labels are renumbered so that classes are sorted, as the JPEG archive's folders are."""
  names = ('zebra', 'ant', 'moth')
  expected = _cifar_binary(tmp_path / 'c.tar.gz', names, [('data_batch_1.bin', 30)], seed=1)
  out = sources.decode_cifar10_binary(str(tmp_path / 'c.tar.gz'))
  images, labels, classes = out['train']
  assert classes == ['ant', 'moth', 'zebra'] and sorted(out) == ['train']
  np.testing.assert_array_equal(images, expected['train'][0])
  np.testing.assert_array_equal(np.asarray(classes)[labels],
                                np.asarray(names)[expected['train'][1]])
  (tmp_path / 'bad.tar.gz').write_bytes(b'')
  with tarfile.open(tmp_path / 'bad.tar.gz', 'w:gz') as tf:
    info = tarfile.TarInfo('x/data_batch_1.bin')
    info.size = 10
    tf.addfile(info, io.BytesIO(b'0' * 10))
  with pytest.raises(ValueError, match='10 bytes, not a multiple of the 3073-byte'):
    sources.decode_cifar10_binary(str(tmp_path / 'bad.tar.gz'))


@needs_data
def test_cifar10_jpeg_archive_from_a_mirror(server, tmp_path, monkeypatch):
  """With a mirror, the JPEG archive itself is fetched (20 MB over loopback; not decoded here)."""
  base, _, _ = server
  decoded = []
  monkeypatch.setattr(sources, 'decode_jpeg_archive', lambda p: decoded.append(p) or {
      'train': (np.zeros((1, 32, 32, 3), np.uint8), np.zeros(1, np.int32), ['a'])})
  data, classes = sources.load_jpeg_archive(None, str(tmp_path), download=True,
                                            base_url=f'{base}/data')
  assert classes == ['a'] and len(data['train']) == 1
  assert decoded == [os.path.join(download.cache_root(str(tmp_path)), sources.JPEG_ARCHIVE)]
  assert download.sha256_of(decoded[0]) == download.REMOTES[sources.JPEG_ARCHIVE].sha256

