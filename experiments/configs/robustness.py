r"""Robustness to the learning rate, the init scale and the width (study `robustness`).

Paper 002 claims GmP works "under less carefully chosen initialization schemes and larger
learning rates". For every dataset and method this trains a grid of Adam learning rates x
initial scales (multipliers of each method's default init, plus a 'careless' N(0, 1) init)
at the dataset's paper width, and a grid of learning rates x hidden widths at the careless
init; several initialization seeds per cell. All cells of one (dataset, method, width) train
in one vmapped `experiments.lib.protocol.fit` call. Datasets: `levy` (paper 002 Sec. 3.5:
50 points, full-batch Adam, MAE), `banana` (1000 points, Adam batch 128, BCE, test accuracy)
and any UCI file of the data directory (one 80/20 split, full-batch Adam, MAE, test RMSE),
and `cifar10`: a small CNN (conv w, pool, conv 2w, pool, global average pool, Dense; 'width'
is w, the first conv's channels) trained with SGD + momentum 0.9 and the softmax
cross-entropy on a reduced CIFAR-10 (the `cifar_*` fields: by default 1000 training and 1000
test images of the data directory's archive, 2x2-averaged to 16x16, w = 8, widths 4, 8, 16, 3
epochs, batch 50, float32; test accuracy; the default grid with 5 methods: 830.8 s on 2 cores). A CNN grid whose estimated memory exceeds `cifar_memory_gb` is refused before any
work. What "init scale" means per method, the divergence rule and the statistics:
`experiments/studies/robustness.py`.

  python -m experiments.main --config=experiments/configs/robustness.py --workdir=/tmp/rob \
      --config.data_dir=../shared/data

`smoke`: levy, banana and yacht, SP and GmP, 3 rates x 2 scales (+ careless) x 2 seeds,
widths 8 and 16, 40 epochs (12 compiled fits; about a minute on 2 busy cores):

  python -m experiments.main --config=experiments/configs/robustness.py:smoke \
      --workdir=/tmp/rob_smoke --config.data_dir=../shared/data

`cifar10`: the CNN alone, longer (5000 training images at 32x32, w = 16, 10 epochs, batch
100; SP, WN, BN, GmP, GmP+IMN; 7 rates x 3 scales (+ careless) x 2 seeds, widths 8, 16, 32;
an estimated ~20 h on 2 cores; 343 s on an H200 with the members vmapped, 2026-11-26):

  python -m experiments.main --config=experiments/configs/robustness.py:cifar10 \
      --workdir=/tmp/rob_cifar10 --config.data_dir=../shared/data \
      --config.cifar_chunk_mb=4096 --config.cifar_memory_gb=100

The CNN at smoke size (seconds): `:smoke --config.datasets=cifar10`.

Any field on the command line, e.g. `--config.datasets=levy,yacht --config.methods=sp,gmp
--config.learning_rates="(0.001,0.01,0.1,1.0)" --config.widths="(10,100)"`.
"""

import ml_collections
from ml_collections import config_dict

from experiments.configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, smoke=False, cifar10=False)
  c = ml_collections.ConfigDict()
  c.study = 'robustness'
  c.data_dir = config_dict.placeholder(str)  # holds banana.csv and uci/ (None: $GEOPARAM_DATA_DIR)
  c.download = False  # fetch a missing banana.csv / paper UCI file into the cache
  c.datasets = 'levy,banana,yacht,concrete,energy'  # levy, banana, any UCI file name
  c.methods = 'sp,wn,bn,gmp'  # among experiments.lib.models.METHODS
  # The paper's {0.001, ..., 0.3} extended on both sides (a log grid, half decades).
  c.learning_rates = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)
  c.init_scales = (0.1, 0.3, 1.0, 3.0, 10.0)  # multipliers of the default init (must hold 1)
  c.widths = (10, 100, 1000)  # hidden widths of the width sweep (careless init)
  c.hidden = 0  # width of the rate x scale grid; 0: each dataset's paper width (levy 100,
  # banana 10, UCI 100)
  c.depth = 1  # hidden layers (gmp_imn and wn_mbn differ from gmp and wn from depth 2 on)
  c.num_seeds = 3  # initialization seeds per cell
  c.seed = 0  # data draw and the first initialization
  c.num_epochs = 1000  # per dataset; plateau and early stopping keep the paper's patience
  c.float64 = True
  c.gmp_glorot_scale = False  # GmP's r starts at 1 (paper Sec. 4.3), not at the Glorot norm
  c.diverge_factor = 2.0  # diverged: a non-finite loss, or final train loss > this x initial
  c.good_tolerance = 0.1  # the good rates: test error within this fraction of the best
  c.plots = True
  # cifar10 (the CNN; the fields above but `datasets`, `methods`, the grids, `num_seeds`, `seed`,
  # `diverge_factor` and `good_tolerance` are the MLP datasets' only).
  c.cache_dir = config_dict.placeholder(str)  # decoded CIFAR-10 (None: ~/.cache/geoparam)
  c.cifar_width = 8  # channels of the first conv (the second has 2x): the rate x scale grid
  c.cifar_widths = (4, 8, 16)  # first-conv channels of the width sweep (careless init)
  c.cifar_train_examples = 1000  # a fixed random subset (seed `seed`); 0: all 50000
  c.cifar_test_examples = 1000  # 0: all 10000
  c.cifar_epochs = 3
  c.cifar_batch_size = 50
  c.cifar_momentum = 0.9  # SGD's (paper 002's CNN optimizer)
  c.cifar_downsample = 2  # f x f average pooling of the images (2: 16x16; 1: CIFAR's 32x32)
  c.cifar_memory_gb = 8.0  # refuse a CNN grid whose estimated memory is above this
  c.cifar_chunk_mb = 0  # CNN activations per vmapped chunk of members (0: one member at a
  # time, the fastest on a CPU; on a GPU e.g. 4096)
  if arg.cifar10:
    c.datasets = 'cifar10'
    c.methods = 'sp,wn,bn,gmp,gmp_imn'
    c.learning_rates = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
    c.init_scales = (0.3, 1.0, 3.0)
    c.num_seeds = 2
    c.cifar_width = 16
    c.cifar_widths = (8, 16, 32)
    c.cifar_train_examples = 5000
    c.cifar_epochs = 10
    c.cifar_batch_size = 100
    c.cifar_downsample = 1
    c.float64 = False
  if arg.smoke:
    c.datasets = 'levy,banana,yacht'
    c.methods = 'sp,gmp'
    c.learning_rates = (0.01, 0.1, 1.0)
    c.init_scales = (1.0, 10.0)
    c.widths = (8, 16)
    c.hidden = 16
    c.num_seeds = 2
    c.num_epochs = 40
    c.float64 = False
    c.cifar_width = 4
    c.cifar_widths = (4, 8)
    c.cifar_train_examples = 400
    c.cifar_test_examples = 200
    c.cifar_epochs = 2
    c.cifar_batch_size = 50
  return c
