r"""Glorot vs He init in a deep ReLU / PReLU MLP, paper 001 (He et al. 2015) (`he_init_depth`).

30 hidden layers of 256 units (ReLU, or PReLU with slopes starting at 0.25),
Glorot-normal or He-normal kernels, zero biases; SGD with momentum 0.9, lr 0.01,
batch 128, weight decay 5e-4 (kernels only), 10 epochs; a 10-class Gaussian
mixture in 100 dimensions, 8192 training and 2048 test points (~1-2 minutes on
2 CPU cores):

  python -m experiments.main --config=experiments/configs/he_init_depth.py --workdir=/tmp/he_init

`cifar10`: the same on 10000 CIFAR-10 training images (2048 test images), read
from `data_dir` (None: $GEOPARAM_DATA_DIR; `--config.download=True` fetches the
official archive into the cache when missing):

  python -m experiments.main --config=experiments/configs/he_init_depth.py:cifar10 \
      --workdir=/tmp/he_init_cifar --config.data_dir=../shared/data

`smoke`: 4 x 32 network, 512 training and 256 test points, 2 epochs (seconds):

  python -m experiments.main --config=experiments/configs/he_init_depth.py:smoke \
      --workdir=/tmp/he_init_smoke

Any field on the command line, e.g. `--config.activations=prelu --config.depth=20`.
"""

import ml_collections
from ml_collections import config_dict

from experiments.configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, smoke=False, cifar10=False)
  c = ml_collections.ConfigDict()
  c.study = 'he_init_depth'
  c.dataset = 'synthetic'  # synthetic (the Gaussian mixture) or cifar10
  c.data_dir = config_dict.placeholder(str)  # cifar10: folder of cifar10-jpeg.tar.gz
  c.cache_dir = config_dict.placeholder(str)  # decoded archive ($GEOPARAM_CACHE_DIR, ~/.cache)
  c.download = False  # cifar10, no archive in data_dir: fetch the official one (170 MB)
  c.activations = 'relu,prelu'  # comma-separated, among relu, prelu
  c.inits = 'glorot,he'  # comma-separated, among glorot, he
  c.train_examples = 8192  # cifar10: a fixed random subset (seed), 0: all
  c.test_examples = 2048
  c.depth = 30  # hidden layers
  c.width = 256  # units per hidden layer
  c.num_epochs = 10
  c.batch_size = 128
  c.learning_rate = 0.01  # SGD, constant
  c.momentum = 0.9
  c.weight_decay = 5e-4  # kernels only (geoparam.decay_mask)
  c.seed = 0  # the data, the init and the data order
  c.plots = True
  if arg.cifar10:
    c.dataset = 'cifar10'
    c.train_examples = 10000
  if arg.smoke:
    c.train_examples = 512
    c.test_examples = 256
    c.depth = 4
    c.width = 32
    c.num_epochs = 2
  return c
