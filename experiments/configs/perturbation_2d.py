r"""One ReLU unit in R^2 perturbed in SP, WN and GmP, paper 002 Sec. 3.4-3.5 / Fig. 1 b-e (`perturbation_2d`).

The unit `w, b ~ N(0, weight_scale^2)` of the reference notebook (seed 1), and
`num_draws` units drawn the same way for the median and maximum changes; every
parameter shifted by each `eps` in its own coordinates; float64; a few seconds:

  python -m experiments.main --config=experiments/configs/perturbation_2d.py \
      --workdir=/tmp/perturbation

`smoke`: 50 draws. Any field on the command line, e.g. `--config.eps="(1e-3,1e-1)"
--config.num_draws=200`.
"""

import ml_collections

from experiments.configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, smoke=False)
  c = ml_collections.ConfigDict()
  c.study = 'perturbation_2d'
  c.eps = (1e-4, 1e-3, 1e-2, 1e-1)  # perturbation sizes, each > 0
  c.weight_scale = 1e-3  # standard deviation of the units' weights and biases
  c.seed = 1  # the drawn unit (1: the reference notebook's unit)
  c.num_draws = 1000  # units drawn for the median/max statistics (unit 0 is the drawn unit)
  c.plots = True
  if arg.smoke:
    c.num_draws = 50
  return c
