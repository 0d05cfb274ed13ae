"""experiments.vision.plot_curves on synthetic metrics.csv files written the way experiments.vision.train does."""

import csv
import os
import subprocess
import sys

import pytest

from experiments.vision import plot_curves as pc

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FIELDS = ('epoch', 'step', 'lr', 'train_loss', 'train_top1', 'train_top5', 'eval_loss',
           'eval_top1', 'eval_top5', 'next_lr', 'best_epoch', 'stop', 'epoch_time',
           'train_images_per_s')


def _write_run(workdir, top1, top5, loss, times, shuffle=False):
  os.makedirs(workdir)
  rows = []
  for i, (a, b, l, t) in enumerate(zip(top1, top5, loss, times)):
    rows.append({'epoch': i + 1, 'step': 10 * (i + 1), 'lr': 0.1, 'train_loss': l,
                 'train_top1': 0.5, 'train_top5': 0.9, 'eval_loss': 2 * l, 'eval_top1': a,
                 'eval_top5': b, 'next_lr': 0.1, 'best_epoch': 1, 'stop': False,
                 'epoch_time': t, 'train_images_per_s': 100.0})
  if shuffle:
    rows = rows[::-1]
  with open(os.path.join(workdir, 'metrics.csv'), 'w', newline='') as f:
    w = csv.DictWriter(f, fieldnames=_FIELDS)
    w.writeheader()
    w.writerows(rows)


A = dict(top1=[0.2, 0.5, 0.4, 0.45], top5=[0.6, 0.8, 0.85, 0.9], loss=[2.0, 1.5, 1.2, 1.1],
         times=[30.5, 10.25, 10.0, 9.75])
B = dict(top1=[0.1, 0.3, 0.3], top5=[0.5, 0.7, 0.75], loss=[2.2, 1.9, 1.8],
         times=[40.0, 20.0, 21.0])


def test_table_numbers_and_png(tmp_path):
  _write_run(tmp_path / 'a', **A)
  _write_run(tmp_path / 'b', **B, shuffle=True)  # rows out of order: sorted by epoch
  out = str(tmp_path / 'figs' / 'curves')
  table = pc.run([('SP', str(tmp_path / 'a')), ('GmP+IMN', str(tmp_path / 'b'))], out, last_k=2)
  assert os.path.getsize(out + '.png') > 1000
  with open(out + '.png', 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  with open(out + '.md') as f:
    assert f.read() == table
  lines = table.splitlines()
  assert len(lines) == 4
  # Independently: A final 0.45/0.9, best 0.5 at epoch 2, mean of last 2 (0.4+0.45)/2=0.425,
  # time 30.5+10.25+10+9.75=60.5; B best 0.3 first reached at epoch 2, mean (0.3+0.3)/2, 81 s.
  # Eval loss is 2 * train loss: A's last two 2.4, 2.2 -> 2.3; B's 3.8, 3.6 -> 3.7.
  assert lines[2] == '| SP | 4 | 0.450 | 0.900 | 0.500 (2) | 0.425 | 2.300 | 60 |'
  assert lines[3] == '| GmP+IMN | 3 | 0.300 | 0.750 | 0.300 (2) | 0.300 | 3.700 | 81 |'
  with open(out + '.csv', newline='') as f:
    rows = list(csv.DictReader(f))
  assert [r['label'] for r in rows] == ['SP', 'GmP+IMN']
  assert float(rows[0]['mean_last_k_top1']) == pytest.approx(0.425)
  assert float(rows[0]['wall_time_s']) == pytest.approx(60.5)
  assert float(rows[1]['final_top5']) == pytest.approx(0.75)
  assert int(rows[1]['epochs']) == 3


def test_other_panels_and_unknown_panel(tmp_path):
  _write_run(tmp_path / 'a', **A)
  out = str(tmp_path / 'fig4')
  pc.run([('SP', str(tmp_path / 'a'))], out, last_k=1, panels=['train_top5', 'eval_top5', 'lr'])
  assert os.path.getsize(out + '.png') > 1000
  with pytest.raises(ValueError, match="'SP' has no numeric column.*stop"):
    pc.run([('SP', str(tmp_path / 'a'))], str(tmp_path / 'x'), panels=['eval_top5', 'stop'])
  assert not os.path.exists(tmp_path / 'x.md')


def test_summarize_last_k_longer_than_the_run_averages_all_epochs(tmp_path):
  _write_run(tmp_path / 'a', **A)
  s = pc.summarize(pc.read_metrics(str(tmp_path / 'a')), last_k=10)
  assert s['mean_last_k_top1'] == pytest.approx(sum(A['top1']) / 4)
  assert s['epochs'] == 4
  with pytest.raises(ValueError, match='last_k'):
    pc.summarize(pc.read_metrics(str(tmp_path / 'a')), last_k=0)


def test_errors_name_the_missing_dir_or_file(tmp_path):
  missing = str(tmp_path / 'nope')
  with pytest.raises(FileNotFoundError, match='nope'):
    pc.read_metrics(missing)
  os.makedirs(tmp_path / 'empty')
  with pytest.raises(FileNotFoundError, match=r'empty.*metrics\.csv'):
    pc.read_metrics(str(tmp_path / 'empty'))
  (tmp_path / 'bad').mkdir()
  (tmp_path / 'bad' / 'metrics.csv').write_text('epoch,train_loss\n1,2.0\n')
  with pytest.raises(ValueError, match='eval_top1'):
    pc.read_metrics(str(tmp_path / 'bad'))
  with pytest.raises(FileNotFoundError, match='nope'):
    pc.run([('x', missing)], str(tmp_path / 'out'))
  assert not os.path.exists(tmp_path / 'out.png')


def test_parse_runs():
  assert pc.parse_runs(['SP=/a', ' BN = /b/c=d']) == [('SP', '/a'), ('BN', '/b/c=d')]
  for bad in (['SP'], ['=/a'], ['SP='], []):
    with pytest.raises(ValueError):
      pc.parse_runs(bad)
  with pytest.raises(ValueError, match='twice'):
    pc.parse_runs(['SP=/a', 'SP=/b'])


def test_main_reports_a_missing_run_without_a_traceback(tmp_path):
  out = subprocess.run([sys.executable, '-m', 'experiments.vision.plot_curves',
                        f'--runs=A={tmp_path / "gone"}', f'--out={tmp_path / "o"}'],
                       capture_output=True, text=True, cwd=_ROOT)
  assert out.returncode == 1
  assert out.stderr.strip() == f"plot_curves: run directory '{tmp_path / 'gone'}' does not exist."


def test_import_does_not_choose_a_matplotlib_backend():
  code = ('import sys; import experiments.vision.plot_curves; '
          'print("matplotlib" in sys.modules)')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                       cwd=_ROOT)
  assert out.stdout.strip() == 'False'
