"""Issue 35: bad inputs a Flax user tried that gave an obscure error or a silently wrong result.

Each case now gets a clear ValueError/TypeError naming the argument and what is accepted,
raised before any work.
"""

import re

import jax
import numpy as np
import pytest

import geoparam
from geoparam import methods


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
