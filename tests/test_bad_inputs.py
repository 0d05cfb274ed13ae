"""Issue 35: bad inputs a Flax user tried that gave an obscure error or a silently wrong result.

Each case now gets a clear ValueError/TypeError naming the argument and what is accepted,
raised before any work.
"""

import io
import os
import re
import tarfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
import pytest

import geoparam
from geoparam import methods
from tests import cli_fork


# ----------------------------------------------------------------------------- the registry

def test_register_refuses_to_replace_a_method_unless_override():
  before = methods.REGISTRY['gmp']
  with pytest.raises(ValueError, match=r"method 'gmp' is already registered .*override=True"):
    methods.register('gmp', lambda: methods.get('wn'))
  assert methods.REGISTRY['gmp'] is before
  methods.register('gmp', before)  # the same factory again: a no-op
  try:
    methods.register('gmp', lambda: before()._replace(name='mine'), override=True)
    assert methods.get('gmp').name == 'mine'
  finally:
    methods.register('gmp', before, override=True)
  with pytest.raises(TypeError, match='positional'):
    methods.register('gmp', before, True)  # override is keyword-only


@pytest.mark.parametrize('bad', [['gmp'], ('gmp',), None, 3])
def test_get_of_a_non_name_is_a_type_error_listing_the_names(bad):
  with pytest.raises(TypeError, match=r"method must be a registry name \(one of \('gmp', "
                                      r"'gmp_imn', 'lcw', 'cwn', 'wn'\)\) or a "
                                      r'geoparam.methods.Method, got .* of type'):
    methods.get(bad)


def test_with_imn_takes_a_method_or_a_name():
  with pytest.raises(TypeError, match=r'with_imn: method must be a registry name or a '
                                      r'geoparam.methods.Method, got \[.gmp.\] of type list'):
    methods.with_imn(['gmp'])
  with pytest.raises(ValueError, match=r"method must be one of .* got 'gmpp'"):
    methods.with_imn('gmpp')
  wn_imn = methods.with_imn('wn', momentum=0.9)  # a name is built by methods.get
  assert (wn_imn.name, wn_imn.imn) == ('wn', methods.IMN(0.9, None))


def test_a_factory_that_returns_no_method_fails_in_get_naming_it():
  methods.register('returns_int', lambda: 3)
  try:
    with pytest.raises(TypeError, match=r"factory registered as method 'returns_int' .*returned "
                                        r'3 of type int, not a geoparam.methods.Method'):
      methods.get('returns_int')
  finally:
    del methods.REGISTRY['returns_int']


@pytest.mark.parametrize('shape', [(4,), (), (4, 0), (0, 3), (3, 0, 2)])
def test_init_refuses_kernel_shapes_without_units_or_fan_in(shape):
  with pytest.raises(ValueError, match=r'kernel_shape must be at least 2 ints >= 1, the fan-in '
                                       rf'axes then the units .*got {re.escape(str(shape))}'):
    methods.init(methods.get('wn'), jax.random.key(0), shape)


# ----------------------------------------------------------------------------- convert

@pytest.mark.parametrize('shape', [(8, 0), (0, 3), (3, 3, 0, 4)])
def test_dense_to_gmp_of_an_empty_kernel(shape):
  with pytest.raises(ValueError, match=rf'kernel of shape {re.escape(str(shape))} is empty: it '
                                       'needs at least one unit'):
    geoparam.convert.dense_to_gmp(np.zeros(shape))


# ----------------------------------------------------------------------------- zero vectors

def test_boundary_location_of_zero_weight_units_raises_eagerly_and_is_nan_traced():
  sp = {'kernel': np.array([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]), 'bias': np.array([1.0, 1.0, -2.0])}
  with pytest.raises(ValueError, match=r"boundary_location\(kind='sp'\): units \[0, 2\] have a "
                                       r'zero weight vector \(w = 0\)'):
    geoparam.analysis.boundary_location(sp, 'sp')
  wn = {'kernel': np.ones((2, 2)), 'scale': np.array([0.0, 1.0])}
  with pytest.raises(ValueError, match=r"kind='wn'\): units \[0\] have a zero weight vector"):
    geoparam.analysis.boundary_location(wn, 'wn')
  with pytest.raises(ValueError, match=r"kind='lcw'\): units \[1\]"):  # a registry method
    geoparam.analysis.boundary_location({'v': np.array([[1.0, 0.0]]), 'bias': np.zeros(2)}, 'lcw')
  location = lambda p: geoparam.analysis.boundary_location(p, 'sp')
  phi = np.asarray(jax.jit(location)(sp))  # traced: no values to check, documented NaN rows
  assert np.all(np.isnan(phi[[0, 2]])) and np.all(np.isfinite(phi[1]))
  stacked = jax.tree.map(lambda a: np.stack([a, a]), sp)
  assert np.all(np.isnan(np.asarray(jax.vmap(location)(stacked))[:, [0, 2]]))
  ok = {'kernel': np.ones((2, 3)), 'bias': np.ones(3)}
  np.testing.assert_allclose(location(ok), -0.5 * np.ones((3, 2)))


def test_angle_between_a_zero_vector_raises_eagerly_and_is_nan_traced():
  angle = geoparam.hyperspherical.angle_between
  with pytest.raises(ValueError, match=r'angle_between: u is zero \(all 3 entries are 0\): a zero '
                                       'vector has no direction'):
    angle(np.zeros(3), np.ones(3))
  with pytest.raises(ValueError, match='angle_between: v is zero'):
    angle(np.ones(2), np.zeros(2))
  assert np.isnan(jax.jit(angle)(np.zeros(3), np.ones(3)))
  assert np.all(np.isnan(jax.vmap(angle)(np.zeros((2, 3)), np.ones((2, 3)))))


# ----------------------------------------------------------------------------- the linen transform

def _spec(names):
  return nn.with_partitioning(nn.initializers.lecun_normal(), names)


class _Block(nn.Module):

  @nn.compact
  def __call__(self, h, _):
    return nn.Dense(8, kernel_init=_spec(('mlp', 'embed')), name='dense')(h), None


class _Sharded(nn.Module):
  """Dense -> BatchNorm (dropped) -> LayerNorm (never touched) -> scanned Dense -> DenseGeneral,
  every param partitioned."""

  @nn.compact
  def __call__(self, x):
    ones, zeros = nn.initializers.ones, nn.initializers.zeros
    x = nn.Dense(8, kernel_init=_spec(('embed', 'mlp')),
                 bias_init=nn.with_partitioning(zeros, ('mlp',)), name='up')(x)
    x = nn.BatchNorm(True, scale_init=nn.with_partitioning(ones, ('mlp',)),
                     bias_init=nn.with_partitioning(zeros, ('mlp',)), name='bn')(x)
    x = nn.LayerNorm(scale_init=nn.with_partitioning(ones, ('mlp',)), name='norm')(x)
    x, _ = nn.scan(_Block, variable_axes={'params': 0}, split_rngs={'params': True}, length=2,
                   metadata_params={nn.PARTITION_NAME: 'layers'})(name='blocks')(x, None)
    return nn.DenseGeneral((2, 4), kernel_init=_spec(('embed', 'heads', 'kv')), name='qkv')(x)


def test_partitioning_survives_to_reparameterized_and_bake():
  """Both stripped every nn.Partitioned box (the LayerNorm's too): get_partition_spec gave P()."""
  model, x = _Sharded(), jnp.ones((4, 3))
  sp = model.init(jax.random.key(0), x)
  rp = geoparam.reparameterize(model, 'gmp', drop_batchnorm=True)
  new = geoparam.to_reparameterized(rp, sp, x)
  # the converted layers carry the specs the wrappers give them at init (the kernel's, relabelled)
  specs = nn.get_partition_spec(new)['params']
  assert specs == nn.get_partition_spec(rp.init(jax.random.key(0), x))['params']
  assert specs['norm'] == {'scale': P('mlp'), 'bias': P()}
  assert specs['up'] == {'theta': P(None, 'mlp'), 'lam': P('mlp'), 'scale': P('mlp')}
  assert specs['blocks']['dense']['theta'] == P('layers', None, 'embed')  # the scan's axis kept
  assert specs['qkv']['theta'] == P(None, 'heads')
  baked = geoparam.bake(rp, new, x)
  assert nn.get_partition_spec(baked) == nn.get_partition_spec(sp)
  np.testing.assert_allclose(model.apply(baked, x), model.apply(sp, x), atol=1e-5)


def test_a_model_that_is_one_layer_converts_and_bakes():
  """Was IndexError: tuple index out of range (its path is the root, ())."""
  x = jax.random.normal(jax.random.key(1), (4, 3))
  for method in ('gmp', 'gmp_imn', 'lcw'):
    layer = nn.Dense(4)
    sp = layer.init(jax.random.key(0), x)
    if method == 'lcw':
      sp = jax.tree.map(lambda a: a - a.mean(0) if a.ndim == 2 else a, sp)
    rp = geoparam.reparameterize(layer, method)
    new = geoparam.to_reparameterized(rp, sp, x)
    assert jax.tree.structure(new) == jax.tree.structure(rp.init(jax.random.key(0), x))
    np.testing.assert_allclose(rp.apply(new, x), layer.apply(sp, x), atol=1e-5)
    baked = geoparam.bake(rp, new, x)
    assert jax.tree.structure(baked) == jax.tree.structure(sp)
    np.testing.assert_allclose(layer.apply(baked, x), layer.apply(sp, x), atol=1e-5)



class _Conv(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Conv(8, (3, 3), name='conv')(x)


def test_bake_with_an_example_of_another_shape_names_the_layer_and_both_shapes():
  """Was "kernel_shape (3, 3, 5, 8) does not hold a (27, 8) kernel"."""
  rp = geoparam.reparameterize(_Conv(), 'gmp')
  variables = rp.init(jax.random.key(0), jnp.ones((2, 6, 6, 3)))
  with pytest.raises(ValueError, match=r"bake: the example inputs give layer conv inputs of shape "
                                       r"\(2, 6, 6, 5\), for which 'gmp' needs params .*'theta': "
                                       r"\(44, 8\).* but the variables hold .*'theta': \(26, 8\)"):
    geoparam.bake(rp, variables, jnp.ones((2, 6, 6, 5)))


class _MLP(nn.Module):
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(8, use_bias=self.use_bias, name='hidden')(x))
    return nn.Dense(2, name='head')(x)


def test_imn_on_an_empty_batch():
  """Training step and init: was ZeroDivisionError: integer modulo by zero (nn.BatchNorm gives
  NaN; we refuse); evaluation gives the empty output, as the plain model does."""
  rp = geoparam.reparameterize(_MLP(), 'gmp_imn')
  x, empty = jnp.ones((4, 3)), jnp.ones((0, 3))
  variables = rp.init(jax.random.key(0), x)
  says = (r"Dense at 'hidden': 'gmp_imn' has IMN, which subtracts the batch mean of the inputs "
          r'in training and init, but the inputs \(shape \(0, 3\)\) hold no example')
  with pytest.raises(ValueError, match=says):
    rp.apply(variables, empty, mutable=['batch_stats'])
  with pytest.raises(ValueError, match=says):
    rp.init(jax.random.key(0), empty)
  with pytest.raises(ValueError, match=r"GmP\(Dense\): 'gmp_imn' has IMN, .* hold no example"):
    geoparam.GmP(nn.Dense(2), input_mean_norm=True).init(jax.random.key(0), empty,
                                                         use_running_average=False)
  assert rp.apply(variables, empty).shape == (0, 2)


def test_to_reparameterized_under_imn_with_an_empty_or_nan_example_batch():
  """Empty: was numpy's "cannot reshape array of size 0"; NaN: was "bias entries [...] are not
  finite", blaming the bias."""
  model, x = _MLP(), jnp.ones((4, 3))
  rp, sp = geoparam.reparameterize(model, 'gmp_imn'), model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"layer hidden: 'gmp_imn' has IMN, whose running mean "
                                       r".* but that input is empty \(shape \(0, 3\)\): pass "
                                       'example inputs with at least one example'):
    geoparam.to_reparameterized(rp, sp, jnp.ones((0, 3)))
  with pytest.raises(ValueError, match=r'layer hidden: the mean of its input on the example batch '
                                       r'is not finite \(entries \[1\] of 3\)'):
    geoparam.to_reparameterized(rp, sp, x.at[0, 1].set(jnp.nan))


def test_bake_of_a_bias_free_layer_whose_imn_mean_moved_names_imn_and_the_way_out():
  """Was "... its reparameterized form has a nonzero bias: no plain weights match"."""
  model, x = _MLP(use_bias=False), jnp.ones((4, 3))
  rp = geoparam.reparameterize(model, 'gmp_imn')
  variables = rp.init(jax.random.key(0), x)
  _, stats = rp.apply(variables, x + 3.0, mutable=['batch_stats'])
  with pytest.raises(ValueError, match=r"bake: layer hidden has use_bias=False .* but IMN's "
                                       r"running mean of its input moved .*'gmp_imn' subtracts "
                                       r'it .*exclude=\[...\] or a where= .*drop_batchnorm=True'):
    geoparam.bake(rp, {**variables, **stats}, x)
  baked = geoparam.bake(rp, variables, x)  # the mean still 0: bakes exactly
  np.testing.assert_allclose(model.apply(baked, x), rp.apply(variables, x), atol=1e-5)



def test_the_linen_transform_and_wrappers_refuse_bad_arguments_by_name():
  """The sweep (issue 35 item 7): each was obscure (a bare Python error) or silently accepted."""
  model, x = _MLP(), jnp.ones((4, 3))
  sp = model.init(jax.random.key(0), x)
  rp = geoparam.reparameterize(model, 'gmp')
  rv = rp.init(jax.random.key(0), x)
  for bad in (3, None, ['head', 3]):  # was "'int' object is not iterable", ...
    with pytest.raises(TypeError, match=r'exclude must be layer names or .* got'):
      geoparam.reparameterize(model, 'gmp', exclude=bad)
  for bad in ('yes', 1):  # was accepted, by truthiness
    with pytest.raises(TypeError, match='use_running_average must be None, True or False'):
      geoparam.reparameterize(model, 'gmp_imn', use_running_average=bad)
  with pytest.raises(TypeError, match=r"GmP\(Dense\): use_running_average must be None, True or "
                                      "False, got 'no'"):  # was IMN frozen, silently
    geoparam.GmP(nn.Dense(2), input_mean_norm=True).init(jax.random.key(0), x,
                                                         use_running_average='no')
  with pytest.raises(TypeError, match=r"where must return a bool; for the layer at 'hidden'"):
    geoparam.reparameterize(model, 'gmp', where=lambda layer, path: jnp.ones(2)).init(
        jax.random.key(0), x)  # was numpy's "truth value of an array ... is ambiguous"
  for fn in (geoparam.to_reparameterized, geoparam.bake):  # was AttributeError 'get_method'
    name = fn.__name__
    with pytest.raises(TypeError, match=rf'{name} takes the model geoparam.reparameterize '
                                        r'returned, got _MLP'):
      fn(model, sp, x)
    with pytest.raises(TypeError, match=rf'{name}: variables must be a dict of collections'):
      fn(rp, None, x)
  with pytest.raises(TypeError, match="approximate_borders must be True or False, got 'yes'"):
    geoparam.bake(rp, rv, x, approximate_borders='yes')  # was accepted
  with pytest.raises(ValueError, match=r'layer hidden: theta has entries that are not finite'):
    geoparam.bake(rp, jax.tree.map(lambda a: a * jnp.nan, rv), x)  # named no layer
  rpi = geoparam.reparameterize(model, 'gmp_imn')
  nan_mean = rpi.init(jax.random.key(0), x)
  nan_mean['batch_stats']['hidden']['input_mean_norm']['mean'] *= jnp.nan
  with pytest.raises(ValueError, match=r"layer hidden: IMN's running mean has entries that are "
                                       r'not finite \(\[0, 1, 2\] of 3\)'):
    geoparam.bake(rpi, nan_mean, x)  # baked NaN biases, silently


# ----------------------------------------------------------------------------- the CLI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get('GEOPARAM_DATA_DIR') or os.path.join(ROOT, '..', 'shared', 'data')


run_main = cli_fork.run_main  # python -m experiments.main in a forked child (tests/cli_fork.py)
assert_refused = cli_fork.assert_refused  # what tests/test_cli.py asserts


def _archive(folder, cut=None, flip=None):
  """A small `cifar10-jpeg.tar.gz` in `folder` (random, incompressible members), its first `cut`
  bytes only, or with the byte at `flip` inverted."""
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode='w:gz') as tf:
    for name in ('train/cat/0.jpg', 'test/cat/0.jpg'):
      data = np.random.default_rng(0).bytes(1 << 16)
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tf.addfile(info, io.BytesIO(data))
  raw = bytearray(buffer.getvalue())
  if flip is not None:
    raw[flip] ^= 0xFF
  path = folder / 'cifar10-jpeg.tar.gz'
  path.write_bytes(bytes(raw[:cut]))
  return path


def test_cli_refuses_a_truncated_cifar_archive_before_writing_anything(tmp_path):
  path = _archive(tmp_path, cut=70_000)
  workdir = tmp_path / 'run'
  assert_refused(run_main(['--config=experiments/configs/cifar10_cnn.py:smoke',
                           f'--config.data_dir={tmp_path}', f'--workdir={workdir}']),
                 f'--config.data_dir={tmp_path}: {path} is truncated or corrupt (it ends before '
                 'the end of its gzip stream); replace it with a complete copy')
  assert not workdir.exists()


def test_a_corrupt_or_foreign_cifar_archive_is_refused_by_the_data_check(tmp_path):
  from experiments.configs import validate
  for kwargs, says in [(dict(flip=40_000), r'is truncated or corrupt \((BadGzipFile|error): '),
                       (dict(cut=1000), r'is truncated or corrupt \(it ends before the end of '
                                        'its gzip stream')]:
    path = _archive(tmp_path, **kwargs)
    match = rf'--config.data_dir={re.escape(str(tmp_path))}: {re.escape(str(path))} {says}'
    for download in (False, True):  # a local archive is the one the run reads, download or not
      with pytest.raises(validate.ConfigError, match=match):
        validate.check_cifar10(str(tmp_path), download, cache_dir=str(tmp_path / 'cache'))
  (tmp_path / 'cifar10-jpeg.tar.gz').write_text('not an archive')
  with pytest.raises(validate.ConfigError, match=r'is truncated or corrupt \(not a tar archive\)'):
    validate.check_cifar10(str(tmp_path), cache_dir=str(tmp_path / 'cache'))
  _archive(tmp_path)  # complete
  validate.check_cifar10(str(tmp_path), cache_dir=str(tmp_path / 'cache'))


BANANA = '--config=experiments/configs/banana_2d.py:smoke'


def _banana_csv(folder, rows=20):
  lines = ['At1,At2,Class'] + [f'{i / 10},{-i / 10},{1 if i % 2 else -1}' for i in range(rows)]
  (folder / 'banana.csv').write_text('\n'.join(lines) + '\n')
  return folder / 'banana.csv'


def test_cli_refuses_more_banana_points_than_the_file_holds_with_the_other_checks(tmp_path):
  workdir = tmp_path / 'run'
  assert_refused(run_main([BANANA, '--config.num_points=99999', f'--config.data_dir={DATA}',
                           f'--workdir={workdir}']),
                 f'--config.num_points=99999: must be at most 5300, the points in '
                 f'{os.path.join(DATA, "banana.csv")}.')
  assert not workdir.exists()
  from experiments import main as main_lib
  from experiments.configs import validate
  config = main_lib._load_config(os.path.join(ROOT, BANANA.split('=', 1)[1]))
  path = _banana_csv(tmp_path)
  config.data_dir, config.num_points = str(tmp_path), 200
  with pytest.raises(validate.ConfigError, match=rf'--config.num_points=200: must be at most '
                                                 rf'20, the points in {re.escape(str(path))}\.'):
    main_lib.check(config, str(workdir))
  config.download = True  # a local file is still the one read; with none, the reference file's
  with pytest.raises(validate.ConfigError, match='must be at most 20, the points in'):
    main_lib.check(config, str(workdir))
  config.data_dir, config.num_points = str(tmp_path / 'empty'), 99999
  with pytest.raises(validate.ConfigError, match=r'--config.num_points=99999: must be at most '
                                                 r'5300, the points in the reference banana.csv'):
    main_lib.check(config, str(workdir))
  assert not workdir.exists()


def test_cli_names_a_data_file_that_is_not_utf8_text(tmp_path):
  path = _banana_csv(tmp_path)
  path.write_bytes(path.read_bytes().replace(b'0.3,', b'0.3\xe9,'))
  workdir = tmp_path / 'run'
  assert_refused(run_main([BANANA, f'--config.data_dir={tmp_path}', f'--workdir={workdir}']),
                 f'--config.data_dir={tmp_path}: {path}, line 5: not UTF-8 text (byte 0xe9 at '
                 'column 4); expected a CSV text file: the header At1,At2,Class, then rows of two '
                 'numbers and a class -1 or 1.')
  assert not workdir.exists()
  from experiments.data import uci_data
  uci = tmp_path / 'uci'
  uci.mkdir()
  (uci / 'yacht.txt').write_bytes(b'1 2 3\n4 5 6\n\xff\xfe 7 8\n')
  with pytest.raises(ValueError, match=r'yacht.txt, line 3: not UTF-8 text \(byte 0xff at '
                                       r'column 1\); expected a text file of whitespace-separated'):
    uci_data.parse(str(uci / 'yacht.txt'))
  (uci / 'mac.txt').write_bytes(b'1 2 3\r4 5 6\r')  # \r line ends read as before
  assert uci_data.parse(str(uci / 'mac.txt'))[2] == 2


def test_imn_momentum_and_axis_name_of_the_wrong_type_are_named():
  model = nn.Dense(3)
  with pytest.raises(ValueError, match=r"momentum must be a real number in \[0, 1\], got '0.9'"):
    geoparam.reparameterize(model, 'gmp_imn', momentum='0.9')
  with pytest.raises(ValueError, match=r'momentum must be a real number in \[0, 1\]'):
    geoparam.methods.with_imn('gmp', momentum=True)
  with pytest.raises(TypeError, match='axis_name must be None or the name'):
    geoparam.methods.get('gmp_imn', axis_name=0)


def test_use_running_average_with_a_method_without_imn_is_refused():
  with pytest.raises(ValueError, match="method 'gmp' has no IMN"):
    geoparam.reparameterize(nn.Dense(3), 'gmp', use_running_average=True)


# ----------------------------------------------------------------------------- the second sweep

class _DenseBN(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.BatchNorm(use_running_average=True, name='bn')(nn.Dense(8, name='hidden')(x))
    return nn.Dense(2, name='head')(nn.relu(x))


def test_dropping_the_only_batchnorm_leaves_no_empty_batch_stats():
  """Was `batch_stats: {}` after to_reparameterized: rp.init (like Flax) makes no empty
  collection, and the NNX model holds no BatchStat then either."""
  model, x = _DenseBN(), jnp.ones((4, 3))
  sp = model.init(jax.random.key(0), x)
  for method, collections in (('gmp', ['params']), ('gmp_imn', ['batch_stats', 'params'])):
    rp = geoparam.reparameterize(model, method, exclude=['head'], drop_batchnorm=True)
    new = geoparam.to_reparameterized(rp, sp, x)
    assert sorted(new) == collections
    assert jax.tree.structure(new) == jax.tree.structure(rp.init(jax.random.key(0), x))
    np.testing.assert_allclose(rp.apply(new, x), model.apply(sp, x), atol=1e-5)
    baked = geoparam.bake(rp, new, x)  # the BatchNorm's statistics come back
    assert jax.tree.structure(baked) == jax.tree.structure(sp)


def test_apply_with_the_plain_variables_points_to_to_reparameterized():
  """Was Flax's bare 'Could not find parameter named "theta" in scope "/hidden"'."""
  from flax.errors import ScopeParamNotFoundError
  model, x = _MLP(), jnp.ones((4, 3))
  sp = model.init(jax.random.key(0), x)
  rp = geoparam.reparameterize(model, 'gmp', exclude=['head'])
  with pytest.raises(ScopeParamNotFoundError,  # still Flax's error type
                     match=r'parameter named "theta" in scope "/hidden".* geoparam: _MLP.s layer '
                           r"hidden is reparameterized by 'gmp', but the variables hold "
                           r"\['bias', 'kernel'\] there \(the plain model's\): .*"
                           r"geoparam.to_reparameterized\(rp, plain_variables"):
    rp.apply(sp, x)
  layer = nn.Dense(4)  # a one-layer model: the root's params
  one = geoparam.reparameterize(layer, 'lcw')
  with pytest.raises(ScopeParamNotFoundError, match=r"layer <root> is .*'lcw'.*"
                                                    'to_reparameterized'):
    one.apply(layer.init(jax.random.key(0), x), x)


def test_cli_refuses_a_seed_numpy_cannot_take(tmp_path):
  """Was accepted by --dry_run, then a traceback from NumPy's RandomState in the run (rc 1, a
  workdir left)."""
  from experiments import main as main_lib
  from experiments.configs import validate
  config = main_lib._load_config(os.path.join(ROOT, 'experiments/configs/levy_1d.py:smoke'))
  config.seed = 2**32
  with pytest.raises(validate.ConfigError, match=r'--config.seed=4294967296: must be an int >= 0 '
                                                 r'and <= 4294967295'):
    main_lib.check(config, str(tmp_path / 'run'))
  config.seed = 2**32 - 1
  main_lib.check(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_cli_refuses_a_batch_larger_than_the_training_set_before_the_run(tmp_path):
  """Was accepted by --dry_run, then refused after loading the data (traceback, rc 1, workdir
  left)."""
  from experiments import main as main_lib
  from experiments.configs import validate
  _archive(tmp_path)
  config = main_lib._load_config(os.path.join(ROOT, 'experiments/configs/cifar10_cnn.py:smoke'))
  config.data_dir = str(tmp_path)
  config.batch_size = 100_000
  with pytest.raises(validate.ConfigError, match=r'--config.batch_size=100000: must be at most '
                                                 r'50000, the training examples of cifar10_jpeg'):
    main_lib.check(config, str(tmp_path / 'run'))
  config.batch_size, config.train_examples = 128, 100
  with pytest.raises(validate.ConfigError, match=r'--config.batch_size=128: must be at most 100, '
                                                 r'--config.train_examples=100'):
    main_lib.check(config, str(tmp_path / 'run'))
  config.train_examples = 128
  main_lib.check(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('make', [
    lambda **kw: geoparam.GmPDense(4, **kw),
    lambda **kw: geoparam.GmPConv(4, (3,), **kw),
    lambda **kw: geoparam.GmP(nn.Dense(4), **kw),
])
def test_linen_gmp_flags_and_momentum_are_checked_not_truthy_or_ignored(make):
  """Were silent: input_mean_norm='yes' (or glorot_scale='yes') turned IMN on by truthiness, and
  momentum=5.0 without IMN was ignored."""
  x = jnp.ones((2, 5, 3))
  with pytest.raises(TypeError, match=r"input_mean_norm must be True or False, got 'yes'"):
    make(input_mean_norm='yes').init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r'momentum must be a finite real number in \[0, 1\], '
                                       r'got momentum = 5.0'):
    make(momentum=5.0).init(jax.random.key(0), x)
  if not isinstance(make(), geoparam.GmP):
    with pytest.raises(TypeError, match=r"glorot_scale must be True or False, got 'yes'"):
      make(glorot_scale='yes').init(jax.random.key(0), x)


def test_linen_wrapper_given_an_nnx_layer_names_the_nnx_one():
  """Was AttributeError: 'Linear' object has no attribute 'clone'."""
  from flax import nnx
  layer = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r'takes a flax.linen layer, got a flax.nnx.*Linear .*'
                                      r'geoparam.nnx.Reparam'):
    geoparam.Reparam(layer, 'gmp').init(jax.random.key(0), jnp.ones((2, 3)))


def test_linen_layers_check_their_numbers_by_name():
  """Were obscure ("'<=' not supported between 'float' and 'str'", "must be real number, not
  str") or silent (channel_shared='yes' by truthiness)."""
  x = jnp.ones((2, 3))
  for layer in (geoparam.InputMeanNorm(momentum='0.9'), geoparam.MeanOnlyBatchNorm(momentum='0.9')):
    with pytest.raises(ValueError, match=r"momentum must be a real number in \[0, 1\], got '0.9'"):
      layer.init(jax.random.key(0), x, use_running_average=False)
  with pytest.raises(ValueError, match=r"epsilon must be a real number >= 0, got '1e-5'"):
    geoparam.CWNDense(4, epsilon='1e-5').init(jax.random.key(0), x)
  for slope in ('0.25', None):
    with pytest.raises(TypeError, match=r'negative_slope_init must be a real number, got'):
      geoparam.PReLU(negative_slope_init=slope).init(jax.random.key(0), x)
  with pytest.raises(TypeError, match=r"channel_shared must be True or False, got 'yes'"):
    geoparam.PReLU(channel_shared='yes').init(jax.random.key(0), x)


def test_set_learning_rate_refuses_what_is_no_rate():
  """Was silent: a negative, NaN, bool, string or vector rate (or the schedule's state passed
  instead of state.lr) was written into the optimizer's hyperparams."""
  from geoparam import schedules
  state = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1).init({'w': jnp.ones(2)})
  for bad, error in [(-0.1, ValueError), (float('nan'), ValueError), (True, TypeError),
                     ('0.1', TypeError), (jnp.ones(2), ValueError),
                     (schedules.reduce_on_plateau().init(0.1), ValueError)]:
    with pytest.raises(error, match='lr must be'):
      schedules.set_learning_rate(state, bad)
  assert float(schedules.set_learning_rate(state, 0.0).hyperparams['learning_rate']) == 0.0


def test_nnx_sweep_inputs_get_clear_errors_or_the_right_answer():
  """The NNX side of the sweep: each was obscure (ZeroDivisionError, IndexError, 'int' is not
  iterable, AttributeError, str comparisons) or silent (truthy flags, ignored momentum or
  use_running_average, one fixed key for every constrained layer)."""
  from flax import nnx
  import geoparam.nnx as gnnx
  linear = lambda: nnx.Linear(3, 4, rngs=nnx.Rngs(0))
  imn = gnnx.Reparam(linear(), 'gmp_imn', rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"'gmp_imn' has IMN, .* hold no example"):
    imn(jnp.ones((0, 3)))
  x = jnp.ones((2, 3))
  one = gnnx.reparameterize(linear(), 'gmp', x, initialization='layer')  # a one-layer model
  assert isinstance(one, gnnx.Reparam)
  np.testing.assert_allclose(one(x), linear()(x), atol=1e-6)
  back = gnnx.bake(one)
  assert isinstance(back, nnx.Linear)
  np.testing.assert_allclose(back(x), linear()(x), atol=1e-6)
  with pytest.raises(TypeError, match=r'exclude must be layer names'):
    gnnx.reparameterize(linear(), 'gmp', exclude=3)
  with pytest.raises(TypeError, match=r"use_running_average must be None, True or False, got 'no'"):
    gnnx.reparameterize(linear(), 'gmp_imn', use_running_average='no')
  with pytest.raises(ValueError, match=r"method 'gmp' has no IMN"):
    gnnx.reparameterize(linear(), 'gmp', use_running_average=True)
  with pytest.raises(TypeError, match=r"use_running_average must be None, True or False"):
    gnnx.Reparam(linear(), 'gmp_imn', rngs=nnx.Rngs(0), use_running_average='no')(x)
  with pytest.raises(TypeError, match=r'approximate_borders must be True or False'):
    gnnx.bake(one, approximate_borders='yes')
  with pytest.raises(TypeError, match=r'takes an NNX layer, got a flax.linen.*Dense .*'
                                      r'geoparam.Reparam'):
    gnnx.Reparam(nn.Dense(3), 'gmp', rngs=nnx.Rngs(0))
  for make in (lambda **kw: gnnx.GmP(linear(), rngs=nnx.Rngs(0), **kw),
               lambda **kw: gnnx.GmPLinear(3, 4, rngs=nnx.Rngs(0), **kw)):
    with pytest.raises(TypeError, match=r"input_mean_norm must be True or False, got 'yes'"):
      make(input_mean_norm='yes')
    with pytest.raises(ValueError, match=r'momentum must be a finite real number in \[0, 1\], '
                                         r'got momentum = 2.0'):
      make(momentum=2.0)
  with pytest.raises(TypeError, match=r"glorot_scale must be True or False, got 'yes'"):
    gnnx.GmPLinear(3, 4, rngs=nnx.Rngs(0), glorot_scale='yes')
  with pytest.raises(ValueError, match=r"momentum must be a real number in \[0, 1\], got '0.9'"):
    gnnx.InputMeanNorm(3, momentum='0.9')
  with pytest.raises(TypeError, match=r'negative_slope_init must be a real number'):
    gnnx.PReLU(3, negative_slope_init='0.25')
  for cls in (gnnx.LCWLinear, gnnx.CWNLinear):
    with pytest.raises(TypeError, match=r'pass rngs=nnx.Rngs'):
      cls(3, 4)


def test_bake_names_imn_as_why_a_bias_free_layer_cannot_bake_in_both_shells():
  """Was 'nonzero bias' without naming IMN or the way out (NNX)."""
  from flax import nnx
  import geoparam.nnx as gnnx
  x = jax.random.normal(jax.random.key(0), (8, 3)) + 1.0
  layer = gnnx.reparameterize(nnx.Linear(3, 4, use_bias=False, rngs=nnx.Rngs(0)), 'gmp_imn', x)
  layer.input_mean_norm['mean'][...] = layer.input_mean_norm['mean'][...] + 1.0
  with pytest.raises(ValueError,
                     match=r"use_bias=False .* IMN's running mean .*exclude=\[\.\.\.\]"):
    gnnx.bake(layer)


def test_bake_of_a_bias_free_layer_before_a_bias_free_dropped_batchnorm_in_both_shells():
  """Linen said 'no dropped BatchNorm after it' and advised dropping it; NNX named neither."""
  from flax import nnx
  import geoparam.nnx as gnnx

  class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(4, use_bias=False, name='dense')(x)
      return nn.BatchNorm(use_running_average=True, use_bias=False, name='bn')(x)

  class NNX(nnx.Module):
    def __init__(self):
      self.dense = nnx.Linear(3, 4, use_bias=False, rngs=nnx.Rngs(0))
      self.bn = nnx.BatchNorm(4, use_bias=False, use_running_average=True, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.bn(self.dense(x))

  x = jax.random.normal(jax.random.key(0), (8, 3))
  match = (r'layer dense and the dropped BatchNorm bn after it have use_bias=False.*nonzero.*'
           r'drop_batchnorm=False')
  variables = Linen().init(jax.random.key(1), x)
  variables['batch_stats']['bn']['mean'] = jnp.ones(4)  # a shift the bias-free layers must carry
  rp = geoparam.reparameterize(Linen(), 'gmp', drop_batchnorm=True)
  converted = geoparam.to_reparameterized(rp, variables, x)
  np.testing.assert_allclose(rp.apply(converted, x), Linen().apply(variables, x), atol=1e-5)
  with pytest.raises(ValueError, match=match):
    geoparam.bake(rp, converted, x)
  model = NNX()
  model.bn.mean[...] = jnp.ones(4)
  y = model(x)
  gnnx.reparameterize(model, 'gmp', x, drop_batchnorm=True)
  np.testing.assert_allclose(model(x), y, atol=1e-5)
  with pytest.raises(ValueError, match=match):
    gnnx.bake(model)


def test_bake_of_a_conv_whose_mask_is_made_while_tracing_names_it():
  """A mask made inside the model's __call__ is a tracer where bake reads the layer: was
  numpy's TracerArrayConversionError."""

  class Masked(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Conv(4, (3, 3), padding='VALID', mask=jnp.ones((3, 3, 2, 4)), name='conv')(x)

  x = jnp.ones((2, 6, 6, 2))
  rp = geoparam.reparameterize(Masked(), 'gmp_imn')
  converted = geoparam.to_reparameterized(rp, Masked().init(jax.random.key(0), x), x)
  with pytest.raises(ValueError, match=r'layer conv: its mask is a traced array .*made outside'):
    geoparam.bake(rp, jax.tree.map(lambda a: a + 0.3, converted), x)


def test_a_numpy_bool_is_a_flag_in_every_check():
  """One flag check (`checks.flag`): `np.True_`/`np.False_` (from a numpy config or a
  comparison) pass wherever True/False do; a None passes only where the argument is optional."""
  from geoparam import checks  # pylint: disable=g-import-not-at-top
  x = jax.random.normal(jax.random.key(1), (4, 3)) + 2.0
  rp = geoparam.reparameterize(nn.Dense(2), 'gmp_imn', use_running_average=np.False_)
  v = rp.init(jax.random.key(0), x)
  y, _ = rp.apply(v, x, mutable=['batch_stats'])
  np.testing.assert_allclose(y, rp.apply(v, x - x.mean(0), mutable=['batch_stats'])[0],
                             atol=1e-5)  # training mode: the batch mean is subtracted
  geoparam.bake(rp, v, x, approximate_borders=np.True_)
  checks.flag('use_running_average', None, 'InputMeanNorm', optional=True)
  with pytest.raises(TypeError, match=r'^InputMeanNorm: use_running_average must be True or '
                                      r'False, got None\.$'):
    checks.flag('use_running_average', None, 'InputMeanNorm')
