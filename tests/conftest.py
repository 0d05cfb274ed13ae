"""Shared fixtures for the geoparam test suite.

float64 is enabled per test (the `x64` fixture), never globally at import, so
the float32 tests see JAX's default dtypes.
"""

import atexit
import contextlib
import functools
import io
import os
import shutil
import sys
import tempfile
import tracemalloc  # noqa: F401  pylint: disable=unused-import (see below)
import zlib

# XLA's CPU compiler set for many small programs (here, before JAX starts its backend; the xdist
# workers, the subprocesses and the notebook kernels inherit it): LLVM optimization level 1
# instead of 2, and the classic emitters for fused loops instead of the newer fusion emitters.
# The suite's time is mostly compiling: `pytest -n 2 tests` on this 2-core machine, 2026-11-26,
# took 18 min 12 s with XLA's defaults, 16 min 31 s with level 1 and 12 min 6 s with both.
# Only the machine code differs, not XLA's graph passes: every stored result of the suite comes
# out as with the defaults, the Levy float64 table digit for digit (level 0 changes that table,
# so it is not used). Flags set in XLA_FLAGS are kept.
_FAST_COMPILE = {'--xla_backend_optimization_level': '1', '--xla_cpu_use_fusion_emitters': 'false'}
os.environ['XLA_FLAGS'] = ' '.join(
    [os.environ.get('XLA_FLAGS', '')] + [f'{k}={v}' for k, v in _FAST_COMPILE.items()
                                         if k not in os.environ.get('XLA_FLAGS', '')]).strip()

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

# tensorflow_datasets imports its modules under etils' `lazy_imports`, which swaps
# `builtins.__import__` for the whole process. Done mid-suite (the first TFDS test), that window
# caught finalizers of earlier tests' multiprocessing objects (grain workers), whose
# `from .resource_tracker import unregister` then raised, and pytest's unraisable-exception hook,
# importing tracemalloc inside the window, crashed and failed the test around it (CI,
# 2026-11-25). So tracemalloc and TFDS's modules are loaded here, before any test runs.
tfds.data_source, tfds.testing.mock_data  # pylint: disable=pointless-statement


@functools.cache
def xla_cpu_converts_float16() -> bool:
  """Whether XLA compiles float16 <-> float32 conversions here. XLA:CPU built for a vector ISA
  without F16C (`XLA_FLAGS=--xla_cpu_max_isa=SSE4_2`, or such a host) cannot link them
  (`Symbols not found: __extendhfsf2`), so float16 cases skip there, saying so."""
  try:
    there = jax.jit(lambda x: (x.astype(np.float32) + 1).astype(np.float16))
    return bool(np.asarray(there(np.ones(2, np.float16)))[0] == 2)
  except jax.errors.JaxRuntimeError:
    return jax.default_backend() != 'cpu'


NO_FLOAT16 = 'XLA:CPU cannot convert float16 on this vector ISA (no F16C: __extendhfsf2 missing)'


@pytest.fixture
def float16_converts() -> bool:
  """`xla_cpu_converts_float16()`, for a test with a float16 part of its own."""
  return xla_cpu_converts_float16()


def pytest_runtest_setup(item):
  """Skips a test's float16 parameterization where XLA cannot convert float16 (see above)."""
  params = getattr(getattr(item, 'callspec', None), 'params', {})
  if any(map(_is_float16, params.values())) and not xla_cpu_converts_float16():
    pytest.skip(NO_FLOAT16)


def _is_float16(param) -> bool:
  """Whether a test parameter is float16 by name or type (`'float16'`, `jnp.float16`, ...)."""
  try:
    return isinstance(param, (str, type)) and np.dtype(param) == np.float16
  except (TypeError, ValueError):  # a string or class that is no dtype ('a, b' raises ValueError)
    return False


@pytest.fixture(params=['fold', 'subtract'])
def imn_path(request, monkeypatch):
  """Runs the test with IMN folded into the bias and with IMN subtracted from the inputs
  everywhere (`geoparam.methods.run.imn_subtracts` picks one per layer by size; both must be
  exact)."""
  from geoparam.methods import run

  subtract = request.param == 'subtract'
  monkeypatch.setattr(run, 'imn_subtracts', lambda *shapes: subtract)
  return request.param


@pytest.fixture
def x64():
  """Runs the test with 64-bit types enabled."""
  with jax.enable_x64(True):
    yield


# One persistent JAX compilation cache for the whole run, shared by the xdist workers and the
# subprocesses tests start (environment variables): a program compiled by one test (the same
# fixture model in both workers, a study's smoke config in and out of a subprocess, a split
# trained alone then the next with the same shapes) is loaded, not compiled again. Keyed on
# the whole HLO and compile options, so a program that differs still compiles, and a loaded
# one is the same executable (bitwise the same results). The cache starts empty every run and
# is removed at the end. Measured on this 2-core machine, 2026-11-26: 10 min 0 s without it
# (before this session's last test trims), 8 min 52 s with it (after them).
_CACHE_ENV = {'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
              'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0'}


def pytest_configure(config):
  if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:  # the controller (workers inherit it)
    config._geoparam_jax_cache = tempfile.mkdtemp(prefix='geoparam_jax_cache_')
    os.environ['JAX_COMPILATION_CACHE_DIR'] = config._geoparam_jax_cache
    os.environ.update(_CACHE_ENV)
  jax.config.update('jax_compilation_cache_dir', os.environ['JAX_COMPILATION_CACHE_DIR'])
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


def pytest_unconfigure(config):
  made = getattr(config, '_geoparam_jax_cache', None)
  if made:
    shutil.rmtree(made, ignore_errors=True)
  if hasattr(config, 'workerinput') and 'coverage' not in sys.modules:
    # An xdist worker has reported every result by now; Python's finalization would then run
    # JAX's atexit clean-up of every program the worker compiled, which held the end of the
    # suite 2-8 s (2 workers, 2026-11-27). So the worker's own clean-ups run here, and the last
    # atexit handler registered (it runs first) skips the rest.
    from tests import cli_fork  # pylint: disable=g-import-not-at-top
    cli_fork.close_runners()
    atexit.register(_exit_at_once)


def _exit_at_once():
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access


def tfds_record(image: np.ndarray, label: int) -> bytes:
  """A serialized `tf.train.Example` as TFDS stores an image example: the PNG and the label."""
  from PIL import Image
  from tensorflow_datasets.proto import tf_example_pb2

  buf = io.BytesIO()
  Image.fromarray(image).save(buf, format='PNG')
  example = tf_example_pb2.Example()
  example.features.feature['image'].bytes_list.value.append(buf.getvalue())
  example.features.feature['label'].int64_list.value.append(int(label))
  return example.SerializeToString()


@contextlib.contextmanager
def mock_tfds(num_examples: int):
  """`tfds.testing.mock_data` whose data sources return what `tfds.data_source(...,
  deserialize_method=RAW_BYTES)` returns for prepared data: serialized records (`tfds_record`)
  of random images of the dataset's image shape (40-63 px a side where it is unknown) and
  labels, deterministic per dataset and split. Built without TensorFlow."""

  def as_data_source(builder, split, **unused_kwargs):
    features = builder.info.features
    shape, num_classes = features['image'].shape, features['label'].num_classes
    rng = np.random.default_rng(zlib.crc32(f'{builder.name}/{split}'.encode()))
    records = []
    for _ in range(num_examples):
      h, w = (d or int(rng.integers(40, 64)) for d in shape[:2])
      image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
      records.append(tfds_record(image, rng.integers(num_classes)))
    return records

  with tfds.testing.mock_data(as_data_source_fn=as_data_source):
    yield


def ref_to_cartesian(theta):
  """Float64 numpy reference of eq. (10) for one neuron: explicit product loops.

  u_1 = cos t_1, u_k = sin t_1 ... sin t_{k-1} cos t_k, u_n = sin t_1 ... sin t_{n-1}.
  """
  theta = np.asarray(theta, np.float64)
  n = theta.shape[0] + 1
  u = np.empty(n, np.float64)
  for k in range(n):
    p = 1.0
    for j in range(k):
      p *= np.sin(theta[j])
    u[k] = p * (np.cos(theta[k]) if k < n - 1 else 1.0)
  return u


def ref_directions(theta):
  """Reference unit kernel `(n, m)` from angles `(n - 1, m)`, column by column."""
  theta = np.asarray(theta, np.float64)
  return np.stack([ref_to_cartesian(theta[:, j]) for j in range(theta.shape[1])], axis=1)


@pytest.fixture
def ref():
  """The numpy references, as a namespace usable from any test module."""

  class _Ref:
    to_cartesian = staticmethod(ref_to_cartesian)
    directions = staticmethod(ref_directions)

  return _Ref
