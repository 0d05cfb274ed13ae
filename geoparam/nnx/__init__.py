"""geoparam for Flax NNX: the same layers, wrappers and whole-model transform, native NNX.

`import geoparam.nnx` (linen users never need it). Every module holds NNX
variables and calls the methods' pure functions (`geoparam.methods`), as the
linen modules do, so each formula exists once; `reparameterize`/`bake` change a
model in place (`geoparam.nnx.transform`).
"""

from geoparam.he_init import he_normal
from geoparam.he_init import he_uniform
from geoparam.nnx.modules import CWN
from geoparam.nnx.modules import CWNConv
from geoparam.nnx.modules import CWNLinear
from geoparam.nnx.modules import GmP
from geoparam.nnx.modules import GmPConv
from geoparam.nnx.modules import GmPLinear
from geoparam.nnx.modules import InputMeanNorm
from geoparam.nnx.modules import LCW
from geoparam.nnx.modules import LCWConv
from geoparam.nnx.modules import LCWLinear
from geoparam.nnx.modules import MeanOnlyBatchNorm
from geoparam.nnx.modules import PReLU
from geoparam.nnx.modules import Reparam
from geoparam.nnx.modules import WN
from geoparam.nnx.transform import DroppedBatchNorm
from geoparam.nnx.transform import bake
from geoparam.nnx.transform import reparameterize

__all__ = [
  'CWN', 'CWNConv', 'CWNLinear', 'DroppedBatchNorm', 'GmP', 'GmPConv', 'GmPLinear',
  'InputMeanNorm', 'LCW', 'LCWConv', 'LCWLinear', 'MeanOnlyBatchNorm', 'PReLU',
  'Reparam', 'WN', 'bake', 'he_normal', 'he_uniform',
  'reparameterize',
]
