"""geoparam's linen shell: the modules that run inside `flax.linen` models.

* `geoparam.linen.layers`: the paper-form layers (`GmPDense`, `GmPConv`, `LCWDense`, `LCWConv`),
  the baselines (`CWNDense`, `CWNConv`, `StandardizationLayer`) and the layers of their own
  (`InputMeanNorm`, `MeanOnlyBatchNorm`, `PReLU`);
* `geoparam.linen.wrappers`: one wrapper over any method, `Reparam(layer, method)`, and `GmP`,
  `LCW`, `CWN`, `WN`;
* `geoparam.linen.transform`: the whole-model transform (`reparameterize`,
  `to_reparameterized`, `bake`);
* `geoparam.linen.variance`: the minibatch-based initialization and the per-layer variance
  analysis of a linen model.

Users import these names from `geoparam` (`geoparam.GmPDense`, `geoparam.reparameterize`, ...),
which imports this package on their first use: `import geoparam.nnx` does not load it.
The NNX shell is `geoparam.nnx`; both run the framework-neutral core (`geoparam.methods`, ...).
"""

from geoparam.linen import layers
from geoparam.linen import transform
from geoparam.linen import variance
from geoparam.linen import wrappers

__all__ = ['layers', 'transform', 'variance', 'wrappers']
