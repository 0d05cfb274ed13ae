r"""ImageNet (`imagenet2012`), ResNet-50, paper 002 Table 1 (App. C.1).

He et al. (2016) bottleneck ResNet-50 (`experiments.vision.models.ResNet`),
parameterizations `bn` (default), `wn_mbn`, `gmp_imn` (the paper's three; `sp`,
`wn`, `gmp` also build). SGD momentum 0.9, batch 256, lr 0.1 for every method
(the paper's cross-validated choice), LR x0.1 when val top-1 has not improved
for 5 epochs, stop after 10 or at 90 epochs; augmentation: random flip,
shorter side resized in [256, 480], random 224 crop, colour jitter; single
centre crop (resize 256) for evaluation. Needs the TFDS ArrayRecord data
(`tfds build imagenet2012 --file_format=array_record --data_dir=DIR` with the
ILSVRC tars in DIR/downloads/manual).

  python -m experiments.main --config=experiments/configs/imagenet_resnet50.py:method=gmp_imn \
      --workdir=/tmp/in_r50_gmp_imn --config.data_dir=DIR

`smoke` (e.g. on the tests' mock TFDS records): a 1-block, 1/16-width bottleneck
ResNet on 32x32 crops, 16 train / 8 eval examples, one epoch.

(`config.model` names a model of `experiments.vision.models.create_model`;
`experiments.vision.train.create_model` must delegate to it for `resnet50`.)
"""

from experiments.vision import models as vision_models
from experiments.configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, method='bn', smoke=False)
  vision_models.check_parameterization(arg.method, vision_models.RESNET_PARAMETERIZATIONS)
  c = common.base_config()
  c.dataset = 'imagenet2012'
  c.model = 'resnet50'
  c.method = arg.method
  c.width = 1.0
  c.stage_sizes = (3, 4, 6, 3)
  c.learning_rate = 0.1
  c.augment = 'imagenet'
  c.image_size = 224
  c.resize_range = (256, 480)
  c.eval_resize = 256
  c.batch_size = 256
  c.eval_batch_size = 500
  c.num_epochs = 90
  c.log_every = 100
  if arg.smoke:
    c.model = 'resnet'
    c.stage_sizes = (1,)
    c.width = 1 / 16
    c.image_size = 32
    c.resize_range = (32, 40)
    c.eval_resize = 36
    c.batch_size = 8
    c.eval_batch_size = 8
    c.train_examples = 16
    c.eval_examples = 8
    c.num_epochs = 1
    c.log_every = 1
  return c
