"""Defaults shared by the configs, and the `get_config(arg)` argument parser.

Each config file's `get_config(arg)` takes a string such as `smoke` or
`method=gmp,smoke` (big_vision style): `smoke` shrinks the run, `method=NAME`
picks the parameterization AND the paper's learning rate for it (0.1 for GmP,
0.01 for the others, paper 002). Every field can also be overridden on the
command line (`--config.learning_rate=0.05`); the config is locked, so a typo
in a field name is an error.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict


def parse_arg(arg: str | None, **defaults):
  """`'a=1,smoke'` -> ConfigDict(a='1', smoke=True) over `defaults` (values keep their type)."""
  out = dict(defaults)
  for item in filter(None, (arg or '').split(',')):
    key, eq, value = item.partition('=')
    key = key.strip()
    if key not in out:
      raise ValueError(f'unknown config argument {key!r}; accepted: {sorted(out)}.')
    if not eq:
      out[key] = True
    elif isinstance(out[key], bool):
      out[key] = value.lower() in ('1', 'true', 'yes')
    else:
      out[key] = type(out[key])(value)
  return ml_collections.ConfigDict(out)


def paper_lr(method: str, lr_gmp: float = 0.1, lr_others: float = 0.01) -> float:
  """Paper 002's rule: `lr_gmp` (0.1) for GmP and GmP+IMN, `lr_others` (0.01) for the others.

  The one place of the rule: the vision configs and the small studies (their
  `lr_gmp`/`lr_others` fields) call it.
  """
  from experiments.lib import models  # pylint: disable=g-import-not-at-top (configs stay light)
  return lr_gmp if models.is_gmp(method) else lr_others


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Data.
  c.dataset = 'cifar10_jpeg'
  c.data_dir = config_dict.placeholder(str)  # None: $GEOPARAM_DATA_DIR
  c.cache_dir = config_dict.placeholder(str)  # None: $GEOPARAM_CACHE_DIR or ~/.cache/geoparam
  c.download = False  # cifar10_jpeg: no archive in data_dir -> fetch the official one into cache
  c.train_examples = 0  # 0: all
  c.eval_examples = 0
  c.augment = 'flip'  # 'none', 'flip', 'flip_crop', 'imagenet'
  c.image_size = 224  # crop size of the 'imagenet' augmentation
  c.resize_range = (256, 480)
  c.eval_resize = 256
  c.num_workers = 0  # grain worker processes building batches (0: threads of this process)
  c.num_threads = 2  # threads building batches in each process
  c.prefetch = 2  # batches built ahead
  # Model.
  c.model = 'cnn'
  c.layers = (128, 128, 'M', 256, 256, 'M', 512, 512, 'M')  # VGG-6
  c.method = 'sp'
  c.bn_momentum = 0.9
  # Optimizer.
  c.optimizer = 'sgd'
  c.learning_rate = 0.01
  c.momentum = 0.9
  c.nesterov = False
  c.weight_decay = 0.0
  c.decay_names = ('kernel', 'v')  # leaf names decayed (geoparam.masks.decay_mask)
  # LR rule and early stopping (paper 002: x0.1 after 5 epochs without top-1 gain, stop after 10).
  c.lr_schedule = 'plateau'  # 'plateau', 'decay' (x decay_factor per epoch), 'constant'
  c.monitor = 'eval_top1'
  c.monitor_mode = 'max'
  c.plateau_factor = 0.1
  c.plateau_patience = 5
  c.plateau_min_delta = 1e-4
  c.plateau_cooldown = 0
  c.decay_factor = 0.95
  c.min_lr = 0.0
  c.stop_patience = 10  # 0: never stop early
  c.stop_min_delta = 0.0
  c.restore_best = True  # final summary also evaluates the best checkpoint
  # Loop.
  c.num_epochs = 90
  c.batch_size = 256  # global, over all devices and processes
  c.eval_batch_size = 500
  c.seed = 0
  c.mesh_shape = (-1,)  # (data,) or (data, model); -1 = all remaining devices
  c.log_every = 50
  return c
