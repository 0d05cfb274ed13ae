r"""Learning-rate sensitivity of a small byte-level transformer (study `language_model`).

Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training
instabilities", arXiv 2309.14322) train small GPT-style models over a grid of learning rates;
qk-layernorm lowers the learning-rate sensitivity. This study trains a pre-LN decoder-only
transformer on the bytes of a text file (vocabulary 256) for every method (`sp`, `sp_qk` = SP
with qk-layernorm, `wn`, `gmp`, `gmp_imn`, applied with `geoparam.nnx.reparameterize` to the
MLP projections, or to every projection with `--config.where=all`), width and learning rate;
the rates and seeds of one (method, width) train in one compiled, vmapped call. Model, measures
and claims: `experiments/studies/language_model.py`.

Default (5 methods, widths 32 and 64, depth 2, 10 rates 1e-4..3, 2 seeds, 200 steps of 8 x 64
bytes; 10 compiled calls; 19.5 min wall and 12 min CPU time on 2 CPU cores shared with other
jobs, 2026-11-28, stored in docs/results/2026-11-28-cpu-language-model):

  python -m experiments.main --config=experiments/configs/language_model.py \
      --workdir=/tmp/lm --config.data_dir=../shared/data

`smoke`: SP, SP+qk-norm and GmP, widths 16 and 32, depth 1, 3 rates, 1 seed, 30 steps, quick
compilation (6 compiled calls; ~50 s on 2 CPU cores shared with other jobs):

  python -m experiments.main --config=experiments/configs/language_model.py:smoke \
      --workdir=/tmp/lm_smoke --config.data_dir=../shared/data

Any UTF-8 text file (gzipped or not) instead of the default corpus:
`--config.corpus=/path/to/file.txt`.

`gpu`: widths 128, 256 and 512, 4 layers, head size 64, sequence 128, batch 16, 2000 steps, 2
seeds (an accelerator; about 4e16 FLOPs in all, mostly width 512; tokens/s in the table; not
run yet, so its time is not measured):

  python -m experiments.main --config=experiments/configs/language_model.py:gpu \
      --workdir=/tmp/lm_gpu --config.data_dir=../shared/data
"""

import ml_collections
from ml_collections import config_dict

from experiments.configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, smoke=False, gpu=False)
  c = ml_collections.ConfigDict()
  c.study = 'language_model'
  # Data: a UTF-8 text file read as bytes; the last 5% is the validation split.
  c.data_dir = config_dict.placeholder(str)  # holds text/ (None: $GEOPARAM_DATA_DIR)
  c.corpus = config_dict.placeholder(str)  # a text file (None: <data_dir>/text/python-docs-3.11.txt.gz)
  # Methods and where they apply.
  c.methods = 'sp,sp_qk,wn,gmp,gmp_imn'
  c.where = 'mlp'  # 'mlp': the MLP projections; 'all': q, k, v, out and the MLP projections
  # The model: d_model = width, heads = width // head_dim, `depth` blocks at every width.
  c.widths = (32, 64)
  c.depth = 2
  c.head_dim = 16
  c.mlp_ratio = 4
  c.activation = 'relu'  # 'relu' (GmP's home) or 'gelu'
  c.positions = 'learned'  # 'learned' or 'rotary'
  c.qk_norm = False  # qk-layernorm for every method (sp_qk always has it)
  c.z_loss = 0.0  # coefficient of log^2 Z in the training loss (Wortsman: 1e-4)
  # The grid and training (AdamW (0.9, 0.95), clipping, warmup + cosine, independent decay).
  c.learning_rates = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)
  c.num_seeds = 2
  c.seed = 0
  c.num_steps = 200
  c.warmup_fraction = 0.1  # linear warmup over this fraction of the steps, then cosine to 0
  c.batch_size = 8
  c.seq_len = 64
  c.weight_decay = 1e-4  # independent of the rate: p <- p - s(t) (lr * adam + wd * p)
  c.clip_norm = 1.0
  c.val_sequences = 64  # validation windows of seq_len bytes (evenly spaced, fixed)
  c.log_every = 10  # steps per point of the stored curves
  c.diverge_factor = 2.0  # diverged: a non-finite loss, or final train loss > this x initial
  c.good_tolerance = 0.1  # the good rates: validation loss within this fraction of the best
  c.plots = True
  c.quick_compile = False  # XLA backend optimization level 0: compiles ~2.5x faster, runs
  # ~3x slower (measured on 2 CPU cores at the smoke size; for tiny runs only)
  if arg.gpu:
    c.widths = (128, 256, 512)
    c.depth = 4
    c.head_dim = 64
    c.num_steps = 2000
    c.batch_size = 16
    c.seq_len = 128
    c.val_sequences = 256
    c.log_every = 50
  if arg.smoke:
    c.methods = 'sp,sp_qk,gmp'
    c.widths = (16, 32)
    c.depth = 1
    c.head_dim = 16
    c.learning_rates = (1e-3, 3e-2, 1.0)
    c.num_seeds = 1
    c.num_steps = 30
    c.batch_size = 8
    c.seq_len = 32
    c.val_sequences = 16
    c.log_every = 5
    c.quick_compile = True
  return c
