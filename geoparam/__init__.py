"""geoparam: geometric parameterization (GmP), IMN, LCW and characteristic activation analysis.

The public API is re-exported here; submodules hold the pure functions
(`geoparam.hyperspherical`, `geoparam.lcw`, `geoparam.convert`, ...).
"""

from geoparam import analysis
from geoparam import convert
from geoparam import hyperspherical
from geoparam import initializers
from geoparam import kinds
from geoparam import lcw
from geoparam import masks
from geoparam import methods
from geoparam import schedules
from geoparam.linen import transform
from geoparam import variance
from geoparam.linen import wrappers
from geoparam.linen.layers import PReLU
from geoparam.activations import prelu
from geoparam.linen.layers import CWNConv
from geoparam.linen.layers import CWNDense
from geoparam.linen.layers import StandardizationLayer
from geoparam.linen.layers import GmPConv
from geoparam.linen.layers import GmPDense
from geoparam.methods.gmp import gmp_kernel
from geoparam.he_init import he_normal
from geoparam.he_init import he_uniform
from geoparam.linen.layers import LCWConv
from geoparam.linen.layers import LCWDense
from geoparam.masks import decay_mask
from geoparam.linen.transform import Reparameterized
from geoparam.linen.transform import bake
from geoparam.linen.transform import reparameterize
from geoparam.linen.transform import to_reparameterized
from geoparam.linen.wrappers import CWN
from geoparam.linen.wrappers import GmP
from geoparam.linen.wrappers import LCW
from geoparam.linen.wrappers import Reparam
from geoparam.linen.wrappers import WN
from geoparam.linen.layers import InputMeanNorm
from geoparam.linen.layers import MeanOnlyBatchNorm

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
  'prelu',
  'reparameterize',
  'schedules',
  'to_reparameterized',
  'transform',
  'variance',
  'wrappers',
]
