"""The theta -> u map on the CPU as native kernels, compiled on first use.

XLA compiles the CPU map (`hyperspherical`'s `sequential` scheme: a `lax.scan` per pass, in
both branches of a range `lax.cond`) into about fifteen kernels for every distinct theta
shape, which is most of the extra compile time of a GmP model. `native_map.cc`, shipped with
the package, computes the same map and its VJP as two XLA FFI custom calls (float32), so a
model's maps compile to two calls per layer. It is compiled on first use with the system's
C++ compiler (`$CXX`, else `c++`; about 4 s, once per machine) into `<cache>/native`, where
`<cache>` is `$GEOPARAM_CACHE_DIR`, else `~/.cache/geoparam` (the data downloads' cache
too), under a name that hashes the source, the flags, the compiler and its version, jaxlib's
version, the C library and the CPU, so a shared home folder serves machines of different
kinds.

Where it cannot be built or loaded (no compiler, a failed build, an unwritable cache: a
warning says why) or where `GEOPARAM_NATIVE=0` is set, the layers use the `sequential`
scheme: the same values to float32 rounding. `available()` says which,
`unavailable_reason()` why not. Under a sharded `jit` (several CPU devices) XLA hands each
call whole arrays (the result comes back replicated), and `jax.export` refuses the calls
(set `GEOPARAM_NATIVE=0` in a process that exports).

    >>> from geoparam import native
    >>> native.available() or bool(native.unavailable_reason())
    True
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jaxlib

__all__ = ['available', 'unavailable_reason']

_SOURCE = pathlib.Path(__file__).with_name('native_map.cc')
_FLAGS = ('-O3', '-std=c++17', '-shared', '-fPIC', '-fno-math-errno', '-ffp-contract=off', '-w')
_TARGETS = {'geoparam_map_forward': 'GeoparamMapForward',
            'geoparam_map_backward': 'GeoparamMapBackward'}


def _cache_dir() -> pathlib.Path:
  root = os.environ.get('GEOPARAM_CACHE_DIR') or os.path.join(os.path.expanduser('~'), '.cache',
                                                              'geoparam')
  return pathlib.Path(root) / 'native'


def _cpu() -> str:
  """The CPU's kind: its model and feature flags where Linux says them, else its machine."""
  try:
    with open('/proc/cpuinfo') as f:
      return ''.join(sorted({l for l in f if l.startswith(('model name', 'flags', 'Features'))}))
  except OSError:
    return platform.machine() + platform.processor()


def _constants() -> tuple[str, ...]:
  """`-D` flags with the numbers of `hyperspherical`'s float32 sincos (their one home), as
  hexadecimal float literals: exact, so the C++ rounds them to float32 as numpy does."""
  from geoparam import hyperspherical as hs  # imports this module: not at the top

  def literal(values):
    return '{' + ', '.join(float(v).hex() + 'f' for v in values) + '}'

  return (f'-DGEOPARAM_TWO_OVER_PI={float(hs._TWO_OVER_PI).hex()}f',
          f'-DGEOPARAM_PIO2_PARTS={literal(hs._PIO2_PARTS)}',
          f'-DGEOPARAM_SIN_COEFFS={literal(hs._SIN_COEFFS)}',
          f'-DGEOPARAM_COS_COEFFS={literal(hs._COS_COEFFS)}',
          f'-DGEOPARAM_SINCOS_BOUND={float(hs._SINCOS_BOUND).hex()}f')


def _compile(compiler: str, flags: tuple[str, ...], target: pathlib.Path) -> str:
  """Builds the library at `target` (atomically); '' or the compiler's complaint."""
  target.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix='.so', dir=target.parent)
  os.close(fd)
  command = [compiler, *flags, f'-I{jax.ffi.include_dir()}', str(_SOURCE), '-o', tmp]
  try:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode:
      return done.stderr.strip()[-2000:] or f'{compiler} exited with {done.returncode}'
    os.chmod(tmp, 0o755)  # mkstemp made it private: a shared cache serves every user
    os.replace(tmp, target)
    return ''
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def _build(compiler: str) -> ctypes.CDLL | str:
  """The registered library, built or found in the cache, or why it could not be built."""
  version = subprocess.run([compiler, '--version'], capture_output=True, text=True,
                           timeout=60).stdout
  machine = [_SOURCE.read_text(), compiler, version, jaxlib.__version__,
             ' '.join(platform.libc_ver()), _cpu()]
  errors = []
  for flags in (_FLAGS + ('-march=native',), _FLAGS):  # the second: compilers without it
    flags += _constants()
    key = '\n'.join([' '.join(flags)] + machine)
    target = _cache_dir() / f'native_map-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so'
    error = '' if target.exists() else _compile(compiler, flags, target)
    if not error:
      break
    errors.append(error)
  else:
    return f'{compiler} could not build {_SOURCE.name}:\n{errors[-1]}'
  library = ctypes.CDLL(str(target))
  for name, symbol in _TARGETS.items():
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform='cpu')
  return library


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
  """(the registered library, '') or (None, why not); decided once per process."""
  if os.environ.get('GEOPARAM_NATIVE', '1') == '0':
    return None, 'GEOPARAM_NATIVE=0 is set'
  if not hasattr(jax, 'ffi'):
    return None, f'jax {jax.__version__} has no jax.ffi (a newer jax has)'
  compiler = shutil.which(os.environ.get('CXX') or 'c++')
  if compiler is None:
    return None, f'no C++ compiler found (${{CXX}} or c++: {os.environ.get("CXX") or "c++"})'
  if not _SOURCE.is_file():
    return None, f'{_SOURCE} is missing (a broken install?)'
  try:
    built = _build(compiler)
  except Exception as e:  # an unwritable cache, a library that does not load: fall back
    built = f'building or loading it failed: {type(e).__name__}: {e}'
  if isinstance(built, str):
    warnings.warn(f'geoparam.native: {built}\nThe layers use the XLA map instead.')
    return None, built
  return built, ''


def available() -> bool:
  """Whether the native CPU map is built and registered (builds it on the first call)."""
  return _load()[0] is not None


def unavailable_reason() -> str:
  """Why the native map is not available ('' when it is)."""
  return _load()[1]


def _check():
  if not available():
    raise RuntimeError(f'geoparam.native is not available: {unavailable_reason()}')


def forward(theta: jax.Array) -> jax.Array:
  """`u` `(n, *batch)` of float32 angles `(n - 1, *batch)`, n >= 2 (needs `available()`)."""
  _check()
  u = jax.ShapeDtypeStruct((theta.shape[0] + 1,) + theta.shape[1:], theta.dtype)
  return jax.ffi.ffi_call('geoparam_map_forward', u, vmap_method='sequential')(theta)


def backward(theta: jax.Array, g: jax.Array) -> jax.Array:
  """`dL/dtheta` `(n - 1, *batch)` of the cotangent `g` `(n, *batch)` of `forward(theta)`."""
  _check()
  d_theta = jax.ShapeDtypeStruct(theta.shape, theta.dtype)
  return jax.ffi.ffi_call('geoparam_map_backward', d_theta, vmap_method='sequential')(theta, g)
