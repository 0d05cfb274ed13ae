r"""1-D Levy regression, paper 002 Sec. 3.5 / Fig. 2: SP, WN, BN and GmP (`experiments.studies.levy_1d`).

50 noisy points of the Levy function, one hidden layer of 100 ReLU units, Adam
full batch on the MAE, lr 0.1 for GmP and 0.01 for the others, LR x0.1 after
500 epochs without train-loss improvement, early stop after 1000 (best weights
restored), at most 10000 epochs, float64; 5 initialization seeds on the data of
seed 0, vmapped (~10-30 s on a 2-core CPU):

  python -m experiments.main --config=experiments/configs/levy_1d.py --workdir=/tmp/levy

`smoke`: 300 epochs, 2 seeds, patience 30/60, 16 hidden units, all four methods (a few seconds):

  python -m experiments.main --config=experiments/configs/levy_1d.py:smoke \
      --workdir=/tmp/levy_smoke

Any field on the command line, e.g. `--config.methods=sp,gmp --config.num_seeds=2
--config.float64=False --config.lr_gmp=0.05`.
"""

import ml_collections

from experiments.configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, smoke=False)
  c = ml_collections.ConfigDict()
  c.study = 'levy_1d'
  c.methods = 'sp,wn,bn,gmp'  # comma-separated, among experiments.lib.models.METHODS
  c.num_epochs = 10000
  c.seed = 0  # data draw and the first initialization
  c.num_seeds = 5  # initialization seeds, trained together under vmap
  c.float64 = True
  c.lr_gmp = 0.1  # Adam learning rate of gmp and gmp_imn
  c.lr_others = 0.01
  c.plateau_factor = 0.1
  c.plateau_patience = 500  # epochs without train-loss improvement before LR x plateau_factor
  c.stop_patience = 1000  # ... before stopping (best weights restored)
  c.hidden = 100
  c.gmp_glorot_scale = True  # GmP scales start at the Glorot norm (the code that made Fig. 2)
  c.plots = True
  # Learning-rate selection: fixed (lr_gmp / lr_others) or cv (paper 002, Appendix C: per
  # method, cv_folds-fold cross-validation on the training part over lr_grid,
  # then a retrain on the whole training part at the chosen rate; the fixed rows are kept).
  c.lr_selection = 'fixed'
  c.lr_grid = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)  # only with lr_selection=cv; e.g. =0.01,0.1
  c.cv_folds = 5  # only with lr_selection=cv
  if arg.smoke:
    c.num_epochs = 300
    c.num_seeds = 2
    c.plateau_patience = 30
    c.stop_patience = 60
    c.hidden = 16
  return c
