"""The docstrings' examples run (`pytest --doctest-modules` over the library, from `tests`)."""

import doctest
import importlib
import pkgutil

import pytest

import geoparam

MODULES = sorted(
    ['geoparam'] + [m.name for m in pkgutil.walk_packages(geoparam.__path__, 'geoparam.')]
    + ['experiments.vision.models', 'experiments.lib.protocol', 'experiments.configs.validate',
       'experiments.lib.report', 'experiments.lib.lr_search',
       'experiments.studies.robustness', 'experiments.studies.language_model'])


def test_every_subpackage_is_collected():
  assert {'geoparam.nnx', 'geoparam.nnx.modules', 'geoparam.nnx.transform'} <= set(MODULES)


@pytest.mark.parametrize('name', MODULES)
def test_docstring_examples_run(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0, f'{result.failed} of {result.attempted} examples failed in {name}'
