"""geoparam: geometric parameterization (GmP), IMN, LCW and characteristic activation analysis.

The public API is re-exported here; submodules hold the pure functions
(`geoparam.hyperspherical`, `geoparam.lcw`, `geoparam.convert`, ...). The linen
names (the layers, wrappers and whole-model transform of the linen shell,
`geoparam.linen`) are imported on first use, so `import geoparam.nnx` loads no
linen module of geoparam's.
"""

import importlib

from geoparam import analysis
from geoparam import convert
from geoparam import hyperspherical
from geoparam import initializers
from geoparam import kinds
from geoparam import lcw
from geoparam import masks
from geoparam import methods
from geoparam import schedules
from geoparam import variance
from geoparam.activations import prelu
from geoparam.he_init import he_normal
from geoparam.he_init import he_uniform
from geoparam.masks import decay_mask
from geoparam.masks import param_groups
from geoparam.methods.gmp import gmp_kernel

__version__ = '0.1.0'

__all__ = [
  'CWN',
  'CWNConv',
  'CWNDense',
  'GmP',
  'GmPConv',
  'GmPDense',
  'InputMeanNorm',
  'LCW',
  'LCWConv',
  'LCWDense',
  'MeanOnlyBatchNorm',
  'PReLU',
  'Reparam',
  'Reparameterized',
  'WN',
  'StandardizationLayer',
  'analysis',
  'bake',
  'convert',
  'decay_mask',
  'gmp_kernel',
  'he_normal',
  'he_uniform',
  'hyperspherical',
  'initializers',
  'kinds',
  'lcw',
  'masks',
  'methods',
  'param_groups',
  'prelu',
  'reparameterize',
  'schedules',
  'to_reparameterized',
  'variance',
]


# The linen shell's names, by their module in `geoparam.linen`, imported by `__getattr__`
# (PEP 562) when first used; so is `geoparam.linen` itself.
_LINEN = {
    **dict.fromkeys(('CWNConv', 'CWNDense', 'GmPConv', 'GmPDense', 'InputMeanNorm', 'LCWConv',
                     'LCWDense', 'MeanOnlyBatchNorm', 'PReLU', 'StandardizationLayer'), 'layers'),
    **dict.fromkeys(('Reparameterized', 'bake', 'reparameterize', 'to_reparameterized'),
                    'transform'),
    **dict.fromkeys(('CWN', 'GmP', 'LCW', 'Reparam', 'WN'), 'wrappers'),
}


def __getattr__(name):
  """A linen name (or `geoparam.linen`), imported from `geoparam.linen` on its first use."""
  if name in _LINEN:
    value = getattr(importlib.import_module(f'geoparam.linen.{_LINEN[name]}'), name)
  elif name == 'linen':
    value = importlib.import_module('geoparam.linen')
  else:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__) | {'linen'})
