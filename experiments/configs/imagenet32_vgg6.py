r"""ImageNet32 (`imagenet_resized/32x32`), VGG-6, paper 002 Table 2 / Fig. 4.

conv 128,128,pool,256,256,pool,512,512,pool, global average pool, dense 1000;
SGD momentum 0.9, batch 256 (the paper also runs 512 and 1024:
`--config.batch_size=1024`), lr 0.1 for GmP / 0.01 for the others, LR x0.1
when val top-1 has not improved for 5 epochs, stop after 10 or at 90 epochs,
random flips. Needs the TFDS ArrayRecord data
(`tfds build imagenet_resized/32x32 --file_format=array_record --data_dir=DIR`).

  python -m experiments.main --config=experiments/configs/imagenet32_vgg6.py:method=gmp_imn \
      --workdir=/tmp/in32_gmp_imn --config.data_dir=DIR

Several hosts (same command on each, process_id 0..N-1):

  python -m experiments.main --config=experiments/configs/imagenet32_vgg6.py:method=bn \
      --workdir=/shared/in32_bn --coordinator_address=HOST0:1234 --num_processes=N \
      --process_id=I

`smoke` (e.g. on the tests' mock TFDS records): a tiny CNN, 64 train / 32 eval
examples, one epoch.
"""

from experiments.configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, method='sp', smoke=False)
  c = common.base_config()
  c.dataset = 'imagenet_resized/32x32'
  c.method = arg.method
  c.learning_rate = common.paper_lr(arg.method)
  c.augment = 'flip'
  c.batch_size = 256
  c.eval_batch_size = 1000
  c.num_epochs = 90
  if arg.smoke:
    c.layers = (8, 'M', 16)
    c.num_epochs = 1
    c.batch_size = 16
    c.eval_batch_size = 16
    c.train_examples = 64
    c.eval_examples = 32
    c.log_every = 2
  return c
