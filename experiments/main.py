r"""Runs `experiments.train.train_and_evaluate` from a config file and a workdir.

  python -m experiments.main --config=experiments/configs/cifar10_cnn.py:smoke \
      --workdir=/tmp/cifar10_smoke

Several hosts: the same command on every host plus `--coordinator_address`,
`--num_processes` and `--process_id` (or `--distributed_auto` on TPU pods and
clusters JAX detects itself).
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from experiments import sharding
from experiments import train

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file (a get_config(arg) python file).',
                                lock_config=True)
flags.DEFINE_string('workdir', None, 'Directory for metrics, checkpoints and the summary.')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0 (multi-host).')
flags.DEFINE_integer('num_processes', None, 'Number of processes (multi-host).')
flags.DEFINE_integer('process_id', None, 'Index of this process (multi-host).')
flags.DEFINE_bool('distributed_auto', False, 'jax.distributed.initialize() with auto-detection.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Too many command-line arguments: {argv[1:]}')
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                  FLAGS.process_id, auto=FLAGS.distributed_auto)
  train.train_and_evaluate(FLAGS.config, FLAGS.workdir)


if __name__ == '__main__':
  app.run(main)
