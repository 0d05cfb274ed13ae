r"""Boundaries of one GmP unit in R and R^2, paper 002 appendix A / Fig. 5-6 (`activation_boundaries`).

Panels for the `(lam, theta)` pairs of `experiments.studies.activation_boundaries.CASES_1D`
and `CASES_2D`; float64; seconds:

  python -m experiments.main --config=experiments/configs/activation_boundaries.py \
      --workdir=/tmp/boundaries

`smoke` is the same run (it has nothing to shrink).
"""

import ml_collections

from experiments.configs import common


def get_config(arg=None):
  common.parse_arg(arg, smoke=False)
  c = ml_collections.ConfigDict()
  c.study = 'activation_boundaries'
  c.plots = True
  return c
