r"""Deep sigmoid MLP on CIFAR-10, paper 003 Fig. 5: SP, LCW, BN, WN, ... (`deep_sigmoid_mlp`).

50 hidden layers of 256 sigmoid units, SGD with momentum 0.9, weight decay 1e-4
(kernels and LCW v), batch 128, lr 0.1 x0.95 after every epoch down to 0.001;
the minibatch-based init of Sec. 4.3 for SP, LCW, BN+LCW, WN, CWN. The default is
reduced (10000 training and 2000 test images, 5 epochs, methods sp, lcw, bn,
bn_lcw; a few minutes on 2 CPU cores):

  python -m experiments.main --config=experiments/configs/deep_sigmoid_mlp.py \
      --workdir=/tmp/deep_sigmoid --config.data_dir=../shared/data

`full`: the paper's protocol, all 50000 training and 10000 test images, 100
epochs, all eight methods (hours on CPU):

  python -m experiments.main --config=experiments/configs/deep_sigmoid_mlp.py:full \
      --workdir=/tmp/deep_sigmoid_full --config.data_dir=../shared/data

`smoke`: 3 x 16 network, 1000 training and 500 test images, 2 epochs, sp and lcw
(seconds):

  python -m experiments.main --config=experiments/configs/deep_sigmoid_mlp.py:smoke \
      --workdir=/tmp/deep_sigmoid_smoke --config.data_dir=../shared/data

cifar10-jpeg.tar.gz (or the official cifar-10-binary.tar.gz) is read from
`data_dir` (None: $GEOPARAM_DATA_DIR); `--config.download=True` fetches the
official archive into the cache when missing. Any field on the command line,
e.g. `--config.methods=sp,lcw,wn --config.num_epochs=20 --config.train_examples=0`.
"""

import ml_collections
from ml_collections import config_dict

from experiments.configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, smoke=False, full=False)
  c = ml_collections.ConfigDict()
  c.study = 'deep_sigmoid_mlp'
  c.data_dir = config_dict.placeholder(str)  # folder of cifar10-jpeg.tar.gz ($GEOPARAM_DATA_DIR)
  c.cache_dir = config_dict.placeholder(str)  # decoded archive ($GEOPARAM_CACHE_DIR, ~/.cache)
  c.download = False  # no archive in data_dir: fetch the official one (170 MB) into the cache
  # Comma-separated, among sp, lcw, bn, bn_lcw, wn, cwn, sn, sl (experiments.studies.deep_sigmoid_mlp).
  c.methods = 'sp,lcw,bn,bn_lcw'
  c.train_examples = 10000  # a fixed random subset (seed); 0: all 50000
  c.test_examples = 2000  # 0: all 10000
  c.depth = 50  # hidden layers
  c.width = 256  # units per hidden layer
  c.num_epochs = 5
  c.batch_size = 128
  c.learning_rate = 0.1  # initial SGD rate
  c.decay_factor = 0.95  # rate x decay_factor after every epoch ...
  c.min_lr = 0.001  # ... down to min_lr
  c.momentum = 0.9
  c.weight_decay = 1e-4  # kernels and LCW v only (geoparam.decay_mask)
  c.seed = 0  # the subsets, the init and the data order
  c.plots = True
  if arg.full:
    c.methods = 'sp,lcw,bn,bn_lcw,wn,cwn,sn,sl'
    c.train_examples = 0
    c.test_examples = 0
    c.num_epochs = 100
  if arg.smoke:
    c.methods = 'sp,lcw'
    c.train_examples = 1000
    c.test_examples = 500
    c.depth = 3
    c.width = 16
    c.num_epochs = 2
  return c
