r"""Reduced VGG-6 on the offline CIFAR-10 JPEGs: paper 002 Table 2's six methods on a 2-core CPU.

Paper 002's VGG-6 (`models.VGG6_LAYERS`: conv 128,128,pool,256,256,pool,
512,512,pool, global average pool, dense) at width 1/8 (16,16,pool,32,32,
pool,64,64,pool), SGD momentum 0.9, lr 0.1 for `gmp`/`gmp_imn` and 0.01 for
`sp`/`wn`/`wn_mbn`/`bn` (paper 002), LR x0.1 after 5 epochs without eval
top-1 gain, stop after 10, random flips; batch 128. Budget that fits the
shared 2-core CPU (a minute or two per method, most of it compiling): the
first 4,000 training images, the first 1,000 test images, 2 epochs, so the
plateau rule never fires and the numbers are early-training ones, not
Table 2's.

  for m in sp wn wn_mbn bn gmp gmp_imn; do
    python -m experiments.main --config=experiments/configs/cifar10_vgg6.py:method=$m \
        --workdir=/tmp/c10_vgg6_$m --config.data_dir=../shared/data
  done

Arguments: `method=NAME`, `width=F` (channel multiplier of VGG-6, default
0.125; `width=1` is the paper's network), `full` (all 50,000 / 10,000 images and
the paper's 90-epoch budget), `smoke` (width 1/16, 64 / 32 images, one epoch).
"""

from experiments.lib import models
from experiments.vision import models as vision_models
from experiments.configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, method='sp', width=0.125, full=False, smoke=False)
  models.check_methods([arg.method])
  c = common.base_config()
  c.dataset = 'cifar10_jpeg'
  c.model = 'cnn'
  c.method = arg.method
  c.layers = vision_models.scale_layers(models.VGG6_LAYERS, arg.width)
  c.learning_rate = common.paper_lr(arg.method)
  c.augment = 'flip'
  c.batch_size = 128
  c.eval_batch_size = 500
  c.log_every = 20
  if not arg.full:
    c.train_examples = 4_000
    c.eval_examples = 1_000
    c.num_epochs = 2
  if arg.smoke:
    c.layers = vision_models.scale_layers(models.VGG6_LAYERS, 1 / 16)
    c.train_examples = 64
    c.eval_examples = 32
    c.batch_size = 32
    c.eval_batch_size = 32
    c.num_epochs = 1
    c.log_every = 1
  return c
