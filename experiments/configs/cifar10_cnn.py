r"""CIFAR-10 from the offline JPEG archive, VGG-style CNN, paper 002's protocol.

SGD momentum 0.9, batch 256, lr 0.1 for GmP / 0.01 for the others, LR x0.1
after 5 epochs without eval top-1 improvement, stop after 10, at most 90
epochs, random flips. `smoke`: a small CNN (16-32-64 channels) for one epoch.

  python -m experiments.main --config=experiments/configs/cifar10_cnn.py:smoke \
      --workdir=/tmp/cifar10_smoke --config.data_dir=../shared/data

  python -m experiments.main --config=experiments/configs/cifar10_cnn.py:method=gmp_imn \
      --workdir=/tmp/cifar10_gmp_imn

(data directory: `--config.data_dir` or `$GEOPARAM_DATA_DIR`, the folder that
holds `cifar10-jpeg.tar.gz`.)
"""

from experiments.configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, method='sp', smoke=False)
  c = common.base_config()
  c.dataset = 'cifar10_jpeg'
  c.method = arg.method
  c.learning_rate = common.paper_lr(arg.method)
  c.augment = 'flip'
  if arg.smoke:
    c.layers = (16, 'M', 32, 'M', 64)
    c.num_epochs = 1
    c.batch_size = 128
    c.eval_batch_size = 500
    c.log_every = 50
  return c
