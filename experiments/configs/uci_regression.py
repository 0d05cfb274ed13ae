r"""UCI regression, paper 002 Table 3: SP, WN, BN and GmP MLPs on six sets (`uci_regression`).

One hidden layer of 100 ReLU units, 10 random 80/20 splits vmapped, Adam full
batch on the MAE, lr 0.1 for GmP and 0.01 for the others, LR x0.1 after 50
epochs without improvement of the monitored MSE, early stop after 100 (best
weights restored), at most 5000 epochs, float32. `protocol`: `reference`
monitors the test split (what the paper's code did), `clean` a validation part
of the training split:

  python -m experiments.main --config=experiments/configs/uci_regression.py \
      --workdir=workdir/uci_reference --config.data_dir=../shared/data
  python -m experiments.main --config=experiments/configs/uci_regression.py \
      --workdir=workdir/uci_clean --config.protocol=clean --config.data_dir=../shared/data

The files are read from `data_dir` (None: $GEOPARAM_DATA_DIR; its `uci/` folder);
`--config.download=True` fetches missing ones into the cache. `smoke`: yacht, 3
splits, 300 epochs, all four methods (~15 s on 2 cores, mostly compiling):

  python -m experiments.main --config=experiments/configs/uci_regression.py:smoke \
      --workdir=/tmp/uci_smoke --config.data_dir=../shared/data

Any field on the command line, e.g. `--config.datasets=yacht,energy --config.num_splits=4`.
"""

import ml_collections
from ml_collections import config_dict

from experiments.configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, smoke=False)
  c = ml_collections.ConfigDict()
  c.study = 'uci_regression'
  c.data_dir = config_dict.placeholder(str)  # folder holding uci/ (None: $GEOPARAM_DATA_DIR)
  c.download = False  # fetch missing files of the six paper datasets into the cache
  c.datasets = 'boston,concrete,energy,power,wine,yacht'  # comma-separated, files in uci/
  c.methods = 'sp,wn,bn,gmp'  # comma-separated, among experiments.lib.models.METHODS
  c.protocol = 'reference'  # reference (monitor the test split) or clean (a validation split)
  c.num_splits = 10  # random 80/20 splits, trained together under vmap
  c.seed = 0  # splits and initializations
  c.num_epochs = 5000  # full-batch epochs at most
  c.float64 = False
  c.lr_gmp = 0.1  # Adam learning rate of gmp and gmp_imn
  c.lr_others = 0.01
  c.plateau_patience = 50  # epochs without improvement of the monitored MSE before LR x0.1
  c.stop_patience = 100  # ... before stopping (best weights restored)
  c.hidden = 100
  # Learning-rate selection: fixed (lr_gmp / lr_others) or cv (paper 002, Appendix C: per
  # method and split, cv_folds-fold cross-validation on the training part over lr_grid,
  # then a retrain on the whole training part at the chosen rate; the fixed rows are kept).
  c.lr_selection = 'fixed'
  c.lr_grid = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)  # only with lr_selection=cv; e.g. =0.01,0.1
  c.cv_folds = 5  # only with lr_selection=cv
  if arg.smoke:
    c.datasets = 'yacht'
    c.num_splits = 3
    c.num_epochs = 300
  return c
