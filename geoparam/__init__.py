"""geoparam: geometric parameterization (GmP), IMN, LCW and characteristic activation analysis.

The public API is re-exported here; submodules hold the pure functions
(`geoparam.hyperspherical`, `geoparam.convert`, ...).
"""

from geoparam import convert
from geoparam import hyperspherical
from geoparam import initializers
from geoparam import schedules
from geoparam.gmp import GmPConv
from geoparam.gmp import GmPDense
from geoparam.gmp import gmp_kernel
from geoparam.normalization import InputMeanNorm
from geoparam.normalization import MeanOnlyBatchNorm

__version__ = '0.1.0'

__all__ = [
  'GmPConv',
  'GmPDense',
  'InputMeanNorm',
  'MeanOnlyBatchNorm',
  'convert',
  'gmp_kernel',
  'hyperspherical',
  'initializers',
  'schedules',
]
