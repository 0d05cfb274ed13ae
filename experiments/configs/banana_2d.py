r"""2-D Banana classification, paper 002 Sec. 3.5 / Fig. 3: SP, WN, BN, GmP (`banana_2d`).

1000 points of banana.csv split 80/20 and standardized, one hidden layer of 10
ReLU units, sigmoid output and binary cross-entropy, Adam with batch 128, lr 0.1
for GmP and 0.01 for the others, LR x0.1 after 50 epochs without held-out
accuracy improvement, early stop after 100 (best weights restored), at most
5000 epochs, float64; 5 initialization seeds vmapped; with `compare_rates` every
method also trains at the other rate (Fig. 3 a-i):

  python -m experiments.main --config=experiments/configs/banana_2d.py --workdir=/tmp/banana \
      --config.data_dir=../shared/data

banana.csv is read from `data_dir` (None: $GEOPARAM_DATA_DIR); `--config.download=True`
fetches it into the cache when missing. `smoke`: 150 epochs, 2 seeds, patience 10/20,
all four methods at both rates (~20 s):

  python -m experiments.main --config=experiments/configs/banana_2d.py:smoke \
      --workdir=/tmp/banana_smoke --config.data_dir=../shared/data

Any field on the command line, e.g. `--config.methods=sp,gmp --config.compare_rates=False`.
"""

import ml_collections
from ml_collections import config_dict

from experiments.configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, smoke=False)
  c = ml_collections.ConfigDict()
  c.study = 'banana_2d'
  c.data_dir = config_dict.placeholder(str)  # folder holding banana.csv (None: $GEOPARAM_DATA_DIR)
  c.download = False  # fetch a missing banana.csv into the cache (experiments.data.download)
  c.methods = 'sp,wn,bn,gmp'  # comma-separated, among experiments.lib.models.METHODS
  c.num_points = 1000  # drawn from banana.csv, split 80/20
  c.num_epochs = 5000
  c.batch_size = 128  # reshuffled every epoch; the remainder is a smaller last batch (Keras)
  c.seed = 0  # data draw, shuffling and the first initialization
  c.num_seeds = 5  # initialization seeds, trained together under vmap
  c.float64 = True
  c.lr_gmp = 0.1  # Adam learning rate of gmp and gmp_imn
  c.lr_others = 0.01
  c.plateau_patience = 50  # epochs without held-out accuracy improvement before LR x0.1
  c.stop_patience = 100  # ... before stopping (best weights restored)
  c.hidden = 10
  c.compare_rates = True  # also train every method at the other rate (Fig. 3 a-i)
  c.gmp_glorot_scale = True  # GmP scales start at the Glorot norm (the reference code)
  c.plots = True
  # Learning-rate selection: fixed (lr_gmp / lr_others) or cv (paper 002, Appendix C: per
  # method, cv_folds-fold cross-validation on the training part over lr_grid,
  # then a retrain on the whole training part at the chosen rate; the fixed rows are kept).
  c.lr_selection = 'fixed'
  c.lr_grid = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)  # only with lr_selection=cv; e.g. =0.01,0.1
  c.cv_folds = 5  # only with lr_selection=cv
  if arg.smoke:
    c.num_epochs = 150
    c.num_seeds = 2
    c.plateau_patience = 10
    c.stop_patience = 20
  return c
