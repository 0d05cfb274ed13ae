r"""CIFAR-10/100, VGG19 or pre-activation ResNet18 with LCW/WN/CWN/SN, paper 003 Table 1 / Fig. 6.

`model=vgg19` (default) or `model=preact_resnet18`; `method` one of
`experiments.vision.models.CIFAR_PARAMETERIZATIONS` (`bn` is the paper's plain
model, `bn_lcw` its "+LCW", `bn_wn`/`bn_cwn`/`bn_sn` WN, CWN and SN with BN as in the
paper; `sp`/`lcw` are plain and LCW without BN); `dataset=cifar10` (TFDS; the default),
`cifar100` (TFDS) or `cifar10_jpeg` (the offline archive; the default of `smoke` and `reduced`). SGD momentum 0.9, weight decay 5e-4,
batch 128, lr 0.1 decayed to a floor of 0.001: CIFAR-10 300 epochs, x0.95
every 3 epochs; CIFAR-100 500 epochs, x0.95 every 5 epochs (here as the
per-epoch factor 0.95**(1/3) resp. 0.95**(1/5), i.e. the same decay spread
evenly). The paper reports the mean of the last ten epochs' test metrics: read
them from `metrics.csv`. Augmentation is not stated in paper 003: random crop
(pad 4) and flip, the usual CIFAR choice. VGG19 uses dropout 0.5 after its two
hidden dense layers (this needs a `'dropout'` rng in the train step).

  python -m experiments.main \
      --config=experiments/configs/cifar_lcw.py:model=vgg19,method=bn_lcw,dataset=cifar100 \
      --workdir=/tmp/c100_vgg19_bn_lcw --config.data_dir=DIR

`reduced`: a budget for the shared 2-core CPU, not the paper's protocol:
dataset `cifar10_jpeg` (the offline archive), width 1/8 (ResNet18 keeps its
four stages of two blocks; VGG19 keeps its dropout), the first 4,000 training
and first 1,000 test images, 15 epochs (`NUM_EPOCHS_REDUCED`; 1-3 minutes per
run on the 2-core CPU, about 6 s (VGG19) / 8 s (ResNet18) per epoch plus
compilation), the paper's lr 0.1, momentum, weight decay, batch 128 and
CIFAR-10 decay otherwise, so the lr only falls to 0.1 * 0.95**(15/3) = 0.077:
early-training numbers of one seed, not Table 1's.

  python -m experiments.main \
      --config=experiments/configs/cifar_lcw.py:model=vgg19,method=bn_lcw,reduced \
      --workdir=/tmp/gp8/lcw_vgg19_bn_lcw --config.data_dir=../shared/data

`smoke`: 1/16 width (ResNet18: one stage of one block), no dropout, 16 train / 8 eval
examples, one epoch, on the offline archive unless `dataset=` is given (the tests run
`dataset=cifar10,smoke` on mock TFDS records):

  python -m experiments.main --config=experiments/configs/cifar_lcw.py:smoke \
      --workdir=/tmp/lcw_smoke --config.data_dir=../shared/data

(`config.model` names a model of `experiments.vision.models.create_model`;
`experiments.vision.train.create_model` must delegate to it for `vgg19`/`preact_resnet18`.)
"""

from experiments.vision import models as vision_models
from experiments.configs import common

_DATASETS = ('cifar10', 'cifar100', 'cifar10_jpeg')
NUM_EPOCHS_REDUCED = 15  # `reduced`: 1-3 minutes per run on the 2-core CPU (docs/trainer.md)


def get_config(arg=None):
  arg = common.parse_arg(arg, model='vgg19', method='bn_lcw', dataset='', reduced=False,
                         smoke=False)
  # TFDS cifar10 by default; the offline archive for the runs sized for a CPU.
  arg.dataset = arg.dataset or ('cifar10_jpeg' if arg.smoke or arg.reduced else 'cifar10')
  if arg.model not in ('vgg19', 'preact_resnet18'):
    raise ValueError(f"model must be 'vgg19' or 'preact_resnet18', got {arg.model!r}.")
  if arg.dataset not in _DATASETS:
    raise ValueError(f'unknown dataset {arg.dataset!r}; accepted: {", ".join(_DATASETS)}.')
  vision_models.check_parameterization(arg.method, vision_models.CIFAR_PARAMETERIZATIONS)
  if arg.reduced and arg.dataset == 'cifar100':
    raise ValueError('reduced runs on the offline CIFAR-10 archive (cifar10_jpeg); '
                     'drop dataset=cifar100.')
  c = common.base_config()
  c.dataset = arg.dataset
  c.model = arg.model
  c.method = arg.method
  c.width = 1.0
  c.stage_sizes = (2, 2, 2, 2)
  c.dropout_rate = 0.5 if arg.model == 'vgg19' else 0.0
  c.augment = 'flip_crop'
  c.optimizer = 'sgd'
  c.momentum = 0.9
  c.weight_decay = 5e-4
  c.batch_size = 128
  c.eval_batch_size = 500
  c.learning_rate = 0.1
  c.lr_schedule = 'decay'
  every = 5 if arg.dataset == 'cifar100' else 3
  c.decay_factor = 0.95 ** (1 / every)
  c.min_lr = 0.001
  c.num_epochs = 500 if arg.dataset == 'cifar100' else 300
  c.stop_patience = 0
  c.restore_best = False
  if arg.reduced:
    c.dataset = 'cifar10_jpeg'  # CIFAR-10 decay above (every 3 epochs)
    c.width = 1 / 8
    c.train_examples = 4_000
    c.eval_examples = 1_000
    c.num_epochs = NUM_EPOCHS_REDUCED
    c.log_every = 10
  if arg.smoke:
    c.width = 1 / 16
    c.stage_sizes = (1,)
    c.dropout_rate = 0.0
    c.batch_size = 8
    c.eval_batch_size = 8
    c.train_examples = 16
    c.eval_examples = 8
    c.num_epochs = 1
    c.log_every = 1
  return c
