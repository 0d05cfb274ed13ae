r"""Per-epoch curves and a summary table from the `metrics.csv` of several training runs.

Paper 002 Fig. 4 (VGG-6: training loss and test top-1 per epoch, one curve per
parameterization) and paper 003 Fig. 6 (VGG19/ResNet18 with and without LCW)
from the workdirs that `experiments.main` writes:

  python -m experiments.vision.plot_curves \
      --runs=SP=/tmp/gp8/vgg6_sp,BN=/tmp/gp8/vgg6_bn,GmP+IMN=/tmp/gp8/vgg6_gmp_imn \
      --out=/tmp/gp8/vgg6 --last_k=3

writes `/tmp/gp8/vgg6.png` (one panel per `--panels` column against the
epoch; default training loss and eval top-1; Fig. 4 itself shows top-5 training
and validation accuracy: `--panels=train_top5,eval_top5`; Fig. 6 training loss
and accuracy: `--panels=train_loss,train_top1`),
`/tmp/gp8/vgg6.md` (a markdown table) and `/tmp/gp8/vgg6.csv`, and prints the
table. Per run: epochs, final-epoch eval top-1/top-5, best eval top-1 (and its
epoch), the mean eval top-1 of the last `k` epochs (paper 003 reports the mean
of the last ten epochs, with the mean eval loss over the same epochs) and the wall time as the sum of `epoch_time` (training
plus evaluation of every epoch; compilation is inside the first epoch, the
final summary evaluation is not counted).

The functions (`read_metrics`, `summarize`, `markdown_table`, `plot`) are
plain Python for notebooks; matplotlib is imported only when plotting and the
Agg backend is chosen only by `main`.
"""

from __future__ import annotations

import csv
import math
import os
import sys
from typing import Mapping, Sequence

from absl import app
from absl import flags

FLAGS = flags.FLAGS

REQUIRED_COLUMNS = ('epoch', 'train_loss', 'eval_top1', 'eval_top5', 'epoch_time')
SUMMARY_FIELDS = ('label', 'epochs', 'final_top1', 'final_top5', 'best_top1', 'best_epoch',
                  'mean_last_k_top1', 'mean_last_k_loss', 'wall_time_s')
DEFAULT_PANELS = ('train_loss', 'eval_top1')
_AXIS_LABELS = {'train_loss': 'training loss (epoch mean)', 'eval_loss': 'test loss',
                'train_top1': 'training top-1 accuracy', 'train_top5': 'training top-5 accuracy',
                'eval_top1': 'test top-1 accuracy', 'eval_top5': 'test top-5 accuracy',
                'lr': 'learning rate'}


def define_flags():
  """CLI flags; defined only when run as a script (tests and notebooks import the module)."""
  flags.DEFINE_list('runs', None, 'label=DIR pairs, comma separated; DIR holds metrics.csv.')
  flags.DEFINE_string('out', None, 'Output path prefix: writes OUT.png, OUT.md and OUT.csv.')
  flags.DEFINE_integer('last_k', 10, 'Mean eval top-1 over the last k epochs (paper 003: 10).')
  flags.DEFINE_string('title', '', 'Figure title.')
  flags.DEFINE_list('panels', list(DEFAULT_PANELS), 'metrics.csv columns, one panel each '
                    '(Fig. 4 of paper 002: train_top5,eval_top5).')


def parse_runs(items: Sequence[str]) -> list[tuple[str, str]]:
  """['SP=/a', 'BN=/b'] -> [('SP', '/a'), ('BN', '/b')], with errors for malformed items."""
  if not items:
    raise ValueError('no runs given: pass --runs=label=DIR[,label=DIR...].')
  out, seen = [], set()
  for item in items:
    label, eq, workdir = item.partition('=')
    label, workdir = label.strip(), workdir.strip()
    if not eq or not label or not workdir:
      raise ValueError(f'run {item!r} is not of the form label=DIR.')
    if label in seen:
      raise ValueError(f'label {label!r} is given twice.')
    seen.add(label)
    out.append((label, workdir))
  return out


def read_metrics(workdir: str) -> dict[str, list[float]]:
  """The per-epoch columns of `workdir/metrics.csv` as floats, sorted by epoch."""
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f'run directory {workdir!r} does not exist.')
  path = os.path.join(workdir, 'metrics.csv')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path!r} does not exist: {workdir!r} holds no finished epoch '
                            '(metrics.csv is written by experiments.main after each epoch).')
  with open(path, newline='') as f:
    rows = list(csv.DictReader(f))
  if not rows:
    raise ValueError(f'{path!r} has no epoch rows.')
  missing = [c for c in REQUIRED_COLUMNS if c not in rows[0]]
  if missing:
    raise ValueError(f'{path!r} lacks the column(s) {", ".join(missing)}.')
  rows.sort(key=lambda r: float(r['epoch']))
  cols = {}
  for key in rows[0]:
    try:
      cols[key] = [float(r[key]) for r in rows]
    except (TypeError, ValueError):
      continue  # non-numeric columns such as `stop`
  return cols


def summarize(metrics: Mapping[str, Sequence[float]], last_k: int) -> dict[str, float]:
  """Final/best/last-k eval top-1, final top-5 and summed epoch time of one run."""
  if last_k < 1:
    raise ValueError(f'last_k must be >= 1, got {last_k}.')
  top1 = list(metrics['eval_top1'])
  epochs = list(metrics['epoch'])
  best = max(range(len(top1)), key=lambda i: (top1[i], -i))  # first epoch reaching the max
  tail = top1[-last_k:]
  loss_tail = list(metrics['eval_loss'])[-last_k:] if 'eval_loss' in metrics else [math.nan]
  return {'epochs': int(epochs[-1]),
          'final_top1': top1[-1],
          'final_top5': metrics['eval_top5'][-1],
          'best_top1': top1[best],
          'best_epoch': int(epochs[best]),
          'mean_last_k_top1': sum(tail) / len(tail),
          'mean_last_k_loss': sum(loss_tail) / len(loss_tail),
          'wall_time_s': float(sum(metrics['epoch_time']))}


def markdown_table(summaries: Mapping[str, Mapping[str, float]], last_k: int) -> str:
  """One row per run, in the order given."""
  head = ('| run | epochs | top-1 (final) | top-5 (final) | best top-1 (epoch) | '
          f'mean top-1, last {last_k} | mean test loss, last {last_k} | wall time (s) |')
  lines = [head, '|' + '---|' * 8]
  for label, s in summaries.items():
    lines.append(f'| {label} | {s["epochs"]} | {s["final_top1"]:.3f} | {s["final_top5"]:.3f} | '
                 f'{s["best_top1"]:.3f} ({s["best_epoch"]}) | {s["mean_last_k_top1"]:.3f} | '
                 f'{s["mean_last_k_loss"]:.3f} | {s["wall_time_s"]:.0f} |')
  return '\n'.join(lines) + '\n'


def write_csv(summaries: Mapping[str, Mapping[str, float]], path: str):
  with open(path, 'w', newline='') as f:
    w = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
    w.writeheader()
    for label, s in summaries.items():
      w.writerow({'label': label, **{k: s[k] for k in SUMMARY_FIELDS[1:]}})


def check_panels(curves: Mapping[str, Mapping[str, Sequence[float]]], panels: Sequence[str]):
  if not panels:
    raise ValueError('no panels: name at least one metrics.csv column.')
  for label, m in curves.items():
    missing = [p for p in panels if p not in m]
    if missing:
      raise ValueError(f'run {label!r} has no numeric column(s) {", ".join(missing)}; '
                       f'it has {", ".join(sorted(m))}.')


def plot(curves: Mapping[str, Mapping[str, Sequence[float]]], path: str, title: str = '',
         panels: Sequence[str] = DEFAULT_PANELS):
  """One panel per metrics.csv column in `panels` against the epoch, one line per run (PNG)."""
  check_panels(curves, panels)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
  axes = axes[0]
  for label, m in curves.items():
    for ax, key in zip(axes, panels):
      ax.plot(m['epoch'], m[key], 'o-', ms=3, label=label)
  for ax, key in zip(axes, panels):
    ax.set_ylabel(_AXIS_LABELS.get(key, key))
    ax.set_xlabel('epoch')
    ax.grid(alpha=0.3)
  axes[-1].legend(fontsize=8)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(runs: Sequence[tuple[str, str]], out: str, last_k: int = 10, title: str = '',
        panels: Sequence[str] = DEFAULT_PANELS) -> str:
  """Reads every run, writes OUT.png/.md/.csv and returns the markdown table."""
  curves = {label: read_metrics(workdir) for label, workdir in runs}
  check_panels(curves, panels)
  summaries = {label: summarize(m, last_k) for label, m in curves.items()}
  parent = os.path.dirname(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  table = markdown_table(summaries, last_k)
  with open(out + '.md', 'w') as f:
    f.write(table)
  write_csv(summaries, out + '.csv')
  plot(curves, out + '.png', title, panels)
  return table


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.out:
    raise app.UsageError('--out is required (a path prefix for OUT.png, OUT.md, OUT.csv).')
  try:
    runs = parse_runs(FLAGS.runs)
    if FLAGS.last_k < 1:
      raise ValueError(f'--last_k must be >= 1, got {FLAGS.last_k}.')
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  try:
    table = run(runs, FLAGS.out, FLAGS.last_k, FLAGS.title, FLAGS.panels)
  except (FileNotFoundError, ValueError) as e:
    sys.exit(f'plot_curves: {e}')
  print(table, end='')
  print(f'wrote {FLAGS.out}.png, {FLAGS.out}.md, {FLAGS.out}.csv')


if __name__ == '__main__':
  define_flags()
  app.run(main)
