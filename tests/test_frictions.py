"""Frictions a new user met ("The experiments' house", item 5): errors name the real
command-line flags, listings stay short, unparseable data files are named with their line,
resume lines count epochs as the progress lines do."""

import doctest
import importlib
import os
import re

import pytest

from experiments.studies import banana_2d
from experiments.data import download, uci_data
from tests import cli_fork

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.environ.get('GEOPARAM_DATA_DIR', os.path.join(ROOT, '..', 'shared', 'data'))
# Flags that `python -m experiments.main` does not have (its fields are --config.<name>).
OLD_FLAG = re.compile(r'(?<![\w.-])--(download|data_dir|datasets|num_splits)\b')


def _one_line(e) -> str:
  text = str(e.value)
  assert '\n' not in text, text
  return text


# ---------------------------------------------------------------------------
# 1. Messages name --config.download=True / --config.data_dir.

def test_banana_missing_data_names_the_real_flags(tmp_path, monkeypatch):
  monkeypatch.delenv(download.DATA_DIR_ENV, raising=False)
  with pytest.raises(ValueError) as e:
    banana_2d.load_banana(None)
  text = _one_line(e)
  assert '--config.download=True' in text and '--config.data_dir=DIR' in text, text
  assert not OLD_FLAG.search(text), text
  with pytest.raises(ValueError) as e:
    banana_2d.load_banana(str(tmp_path))
  text = _one_line(e)
  assert "banana.csv not found (--config.data_dir='" in text, text
  assert '(--config.download=True; download=True in Python)' in text, text
  assert not OLD_FLAG.search(text), text


def test_uci_errors_name_the_real_flags(tmp_path, monkeypatch):
  monkeypatch.delenv(download.DATA_DIR_ENV, raising=False)
  with pytest.raises(ValueError) as e:
    uci_data.uci_dir(None)
  assert 'pass --config.data_dir=DIR' in _one_line(e)
  with pytest.raises(ValueError) as e:
    uci_data.check_datasets(['yacht'], str(tmp_path / 'nowhere'))
  text = _one_line(e)
  assert text.startswith(f"--config.data_dir='{tmp_path / 'nowhere'}'"), text
  assert 'Pass --config.download=True to fetch boston,' in text and not OLD_FLAG.search(text)
  with pytest.raises(ValueError, match='--config.num_splits must be >= 1'):
    uci_data.make_splits(10, 0, seed=0)


def test_no_message_names_a_flag_the_cli_lacks():
  """No string under experiments/ or geoparam/ tells the user to pass --download, --data_dir,
  --datasets or --num_splits (validate.py rewrites these names; comments and the `tfds build`
  command's own flags excepted)."""
  bad = []
  for top in ('experiments', 'geoparam'):
    for folder, _, files in os.walk(os.path.join(ROOT, top)):
      for name in files:
        path = os.path.join(folder, name)
        if not name.endswith('.py') or path.endswith(os.path.join('configs', 'validate.py')):
          continue
        with open(path) as f:
          for number, line in enumerate(f, start=1):
            code = line.strip()
            if OLD_FLAG.search(code) and not code.startswith('#') and '--file_format' not in code:
              bad.append(f'{os.path.relpath(path, ROOT)}:{number}: {line.strip()}')
  assert not bad, '\n'.join(bad)


# ---------------------------------------------------------------------------
# 2. A data directory of many files: a short listing.

def test_uci_error_lists_a_few_files_with_a_count(tmp_path):
  for i in range(60):
    (tmp_path / f'{"x" * 10}_{i:02d}.dat').write_text('')
  with pytest.raises(ValueError) as e:
    uci_data.check_datasets(['yacht'], str(tmp_path))
  text = _one_line(e)
  assert len(text) < 500, (len(text), text)
  assert 'no UCI .txt files in it or in its uci/ folder (expected one <name>.txt per dataset, ' \
      'e.g. uci/yacht.txt); ' in text, text
  assert ('that directory holds 60 entries: xxxxxxxxxx_00.dat, xxxxxxxxxx_01.dat, '
          'xxxxxxxxxx_02.dat, xxxxxxxxxx_03.dat, xxxxxxxxxx_04.dat, ... (55 more).') in text, text
  # Many .txt files: the valid names are cut too.
  for i in range(30):
    (tmp_path / f'set{i:02d}.txt').write_text('1 2\n3 4\n')
  with pytest.raises(ValueError) as e:
    uci_data.check_datasets(['nope'], str(tmp_path))
  text = _one_line(e)
  assert 'set00, set01, set02, set03, set04, set05, set06, set07, set08, set09, ... (20 more).' \
      in text, text
  assert len(text) < 300, text


# ---------------------------------------------------------------------------
# 3. A file that exists but cannot be parsed: a one-line ValueError with the file and the line.

RAGGED_BANANA = 'At1,At2,Class\n1.0,2.0,1\n1.0,2.0,3.0,-1\n'


def test_ragged_banana_names_file_and_line(tmp_path):
  (tmp_path / 'banana.csv').write_text(RAGGED_BANANA)
  path = str(tmp_path / 'banana.csv')
  with pytest.raises(ValueError) as e:
    banana_2d.load_banana(str(tmp_path))
  assert _one_line(e) == (f"{path}, line 3: 4 columns, expected 3 (At1,At2,Class): "
                          "'1.0,2.0,3.0,-1'.")


@pytest.mark.parametrize('text, problem', [
    ('x,y,label\n1,2,1\n', "line 1: header 'x,y,label', expected 'At1,At2,Class'."),
    ('At1,At2,Class\n1,2,1\n\n1,a,-1\n', "line 4: non-numeric cell 'a'."),
    ('At1,At2,Class\n1,2,0\n', "line 2: class '0', expected -1 or 1."),
    ('At1,At2,Class\n1,nan,1\n', "line 2: non-finite value in '1,nan,1'."),
    ('At1,At2,Class\n\n', 'no data rows after the header At1,At2,Class.'),
])
def test_banana_parse_is_a_check(tmp_path, text, problem):
  from experiments.data import banana_data
  path = tmp_path / 'banana.csv'
  path.write_text(text)
  with pytest.raises(ValueError) as e:
    banana_data.parse(str(path))
  assert _one_line(e) == f'{path}' + (', ' if problem.startswith('line') else ': ') + problem


def test_banana_parse_reads_the_reference_file_and_crlf(tmp_path):
  from experiments.data import banana_data
  path = tmp_path / 'banana.csv'
  path.write_bytes(b'At1,At2,Class\r\n1.5,-2,-1\r\n0.25,3,1\r\n')
  x, y = banana_data.parse(str(path))
  assert x.tolist() == [[1.5, -2.0], [0.25, 3.0]] and y.tolist() == [0, 1]
  if os.path.exists(os.path.join(DATA_DIR, 'banana.csv')):
    x, y = banana_data.parse(os.path.join(DATA_DIR, 'banana.csv'))
    assert x.shape == (5300, 2) and set(y.tolist()) == {0, 1}


def test_uci_check_datasets_parses_the_files(tmp_path):
  """validate.check_data calls check_datasets: a ragged file is refused before the run."""
  (tmp_path / 'uci').mkdir()
  (tmp_path / 'uci' / 'yacht.txt').write_text('1 2 3\n4 5 6 7\n')
  (tmp_path / 'uci' / 'energy.txt').write_text('1 2 3\n4 5 6\n')
  assert uci_data.check_datasets(['energy'], str(tmp_path)) == ('energy',)
  with pytest.raises(ValueError) as e:
    uci_data.check_datasets(['energy', 'yacht'], str(tmp_path))
  assert _one_line(e) == f"{tmp_path / 'uci' / 'yacht.txt'}, line 2: 4 columns, but line 1 has 3."


@pytest.mark.parametrize('config, file, text, says', [
    ('uci_regression.py:smoke', 'uci/yacht.txt', '1 2 3\n4 5 6 7\n',
     '--config.datasets=yacht: {path}, line 2: 4 columns, but line 1 has 3.'),
    ('banana_2d.py:smoke', 'banana.csv', RAGGED_BANANA,
     "--config.data_dir={data}: {path}, line 3: 4 columns, expected 3 (At1,At2,Class): "
     "'1.0,2.0,3.0,-1'."),
])
def test_a_ragged_data_file_is_refused_before_the_workdir(tmp_path, config, file, text, says):
  """The study's check_data parses the file: one line, exit 2, nothing created."""
  path = tmp_path / 'data' / file
  path.parent.mkdir(parents=True)
  path.write_text(text)
  workdir = tmp_path / 'w'
  proc = cli_fork.run_main(  # python -m experiments.main in a forked child (tests/cli_fork.py)
      [f'--config=experiments/configs/{config}', f'--config.data_dir={tmp_path / "data"}',
       f'--workdir={workdir}'])
  assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert proc.stderr.count('\n') == 1, proc.stderr
  assert says.format(path=path, data=tmp_path / 'data') in proc.stderr, proc.stderr[-2000:]
  assert not workdir.exists()


# ---------------------------------------------------------------------------
# 4. The resume line counts epochs from 1, as the progress lines do.

def test_resume_message_counts_epochs_as_the_progress_lines():
  from experiments.vision import train
  assert train.resume_message(390, 1, 390, 10) == (
      'resumed from step 390: after epoch 1/10, continuing with epoch 2/10 at step 0/390')
  assert train.resume_message(500, 1, 390, 10) == (
      'resumed from step 500: in epoch 2/10, at step 110/390')
  assert train.resume_message(100, 0, 390, 10) == (
      'resumed from step 100: in epoch 1/10, at step 100/390')
  assert train.resume_message(3900, 10, 390, 10) == (
      'resumed from step 3900: after epoch 10/10, the last one')


@pytest.mark.parametrize('name', ['experiments.vision.train', 'experiments.data.uci_data',
                                  'experiments.lib.plotting', 'experiments.data.banana_data'])
def test_docstring_examples_run(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0, f'{result.failed} of {result.attempted} examples failed in {name}'


# ---------------------------------------------------------------------------
# 6. Figures: the methods' names as the papers write them, curves inside their axes, marks
# explained.

def _levy_results(bn_floor):
  """Fake results of levy_1d for 2 seeds, 4 hidden units, 6 epochs; BN's changes shrink to
  `bn_floor` (the full run: ~2^-45), SP's units leave the [-12, 12] view."""
  import numpy as np
  rng = np.random.default_rng(0)
  x = np.linspace(-10, 10, 20)[:, None]
  data = {'x_train': x[::2], 'y_train': x[::2] ** 2 / 10, 'x_test': x, 'y_test': x ** 2 / 10}
  results = {}
  for m in ('sp', 'wn', 'bn', 'gmp'):
    dphi = np.full((2, 6), 0.1)
    if m == 'bn':
      dphi[:, 3:] = bn_floor
    locations = rng.uniform(-5, 5, (2, 7, 4))
    if m == 'sp':
      locations[:, 3:, :2] = 40.0
    results[m] = {'rmse': np.array([1.0, 1.1]), 'epochs_run': np.array([6, 6]),
                  'init_pred': np.zeros((2, 20)), 'pred': np.ones((2, 20)),
                  'trace': {'max_dphi': dphi}, 'locations': locations}
  return results, data


def _capture_figures(monkeypatch):
  from experiments.lib import plotting
  figures = {}
  save = plotting.save

  def capture(fig, workdir, name, **kwargs):
    title = kwargs.get('title')
    figures[name] = {'title': title, 'axes': [
        {'title': ax.get_title(), 'ylim': ax.get_ylim(), 'texts': [t.get_text() for t in ax.texts],
         'lines': [(l.get_label(), l.get_ydata()) for l in ax.get_lines()],
         'legend': [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else []}
        for ax in fig.axes],
        'fig_legend': [t.get_text() for legend in fig.legends for t in legend.get_texts()]}
    return save(fig, workdir, name, **kwargs)

  monkeypatch.setattr(plotting, 'save', capture)
  return figures


def test_levy_figures_spell_gmp_keep_curves_inside_and_explain_counts(tmp_path, monkeypatch):
  import numpy as np
  from experiments.studies import levy_1d
  figures = _capture_figures(monkeypatch)
  results, data = _levy_results(2.0 ** -44.5)
  results['wn']['init_pred'][1] = np.linspace(30, -30, 20)  # an initial line far off the data
  levy_1d.plot(results, data, str(tmp_path))
  levy_1d.plot_spectra(results, data, str(tmp_path))
  change = figures['boundary_change.png']['axes'][0]
  assert change['legend'] == ['SP', 'WN', 'BN', 'GmP',
                              r'$|\Delta\phi| = 1$ (paper: GmP stays below)']
  # predictions.png: the y range of the data (0..10) and the trained lines, the far-off initial
  # line clipped and counted in its panel.
  predictions = figures['predictions.png']['axes']
  assert all(-1 < a['ylim'][0] < 0 and 10 < a['ylim'][1] < 11 for a in predictions), predictions
  assert [a['texts'] for a in predictions] == [
      [], ['1 of 2 initial lines\nleave the axis (clipped)'], [], []]
  for label, y in change['lines']:  # every point of every curve inside the y range
    y = np.asarray(y, float)
    assert np.all(y[np.isfinite(y)] >= change['ylim'][0]), (label, y.min(), change['ylim'])
  spectra = figures['location_spectra.png']
  titles = [a['title'] for a in spectra['axes'] if a['title']]
  assert titles[-1].startswith('GmP, seed 0') and not any('GMP' in t for t in titles), titles
  assert any(t.startswith('GmP: test RMSE') for t in
             (a['title'] for a in figures['predictions.png']['axes']))
  counts = [t for a in spectra['axes'] for t in a['texts']]
  assert ' +2' in counts, counts  # SP's two units at phi = 40
  assert '+n at the right: n units with $\\phi_i$ beyond $\\pm$12, off the axis' in \
      spectra['title'], spectra['title']
  for name in ('boundary_change.png', 'location_spectra.png', 'predictions.png'):
    assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize('bn_floor, bottom', [(1e-300, -60.0), (0.0, -30.0)])
def test_levy_boundary_change_draws_tiny_changes_on_the_bottom_edge(tmp_path, monkeypatch,
                                                                    bn_floor, bottom):
  """Changes below 2^-60 (float64 resolution) are drawn at -60; exact zeros at the default
  bottom, -30; the axis ends one unit below."""
  import numpy as np
  from experiments.studies import levy_1d
  figures = _capture_figures(monkeypatch)
  results, data = _levy_results(bn_floor)
  levy_1d.plot(results, data, str(tmp_path))
  change = figures['boundary_change.png']['axes'][0]
  bn = np.asarray(dict(change['lines'])['BN'], float)
  assert change['ylim'][0] == bottom - 1 and bn.min() == bottom, (change['ylim'], bn)


def test_banana_figures_label_the_classes_and_the_180_degree_line(tmp_path, monkeypatch):
  import jax
  import numpy as np
  from experiments.lib import models
  figures = _capture_figures(monkeypatch)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 2))
  y = (x[:, :1] > 0).astype(np.float64)
  data = {'x_train': x[:30], 'y_train': y[:30], 'x_test': x[30:], 'y_test': y[30:]}
  runs = {0.01: {}, 0.1: {}}
  for m in ('sp', 'gmp'):
    model = models.MLP(hidden=(3,), out=1, method=m)
    variables = jax.tree.map(lambda a: np.asarray(a)[None], model.init(
        jax.random.key(0), x, train=False))
    for lr in runs:
      runs[lr][m] = {'model': model, 'lr': lr, 'epochs_run': np.array([2]), 'steps_per_epoch': 1,
                     'locations': rng.normal(size=(1, 3, 3, 2)), 'test_acc': np.array([0.9]),
                     'max_dtheta_deg': np.full((1, 2), 5.0),
                     'final_phi': rng.normal(size=(1, 3, 2)),
                     'final_params': variables['params'],
                     'final_others': {k: v for k, v in variables.items() if k != 'params'}}
  chosen = {'sp': runs[0.01]['sp'], 'gmp': runs[0.1]['gmp']}
  banana_2d.plot(runs, chosen, data, str(tmp_path))
  assert figures['trajectories.png']['fig_legend'] == ['class -1', 'class +1']
  for ax in figures['angle_change.png']['axes']:
    assert ax['legend'][-1] == '180 deg: the largest possible change', ax['legend']
  assert figures['decision_boundaries.png']['fig_legend'] == [
      'class -1 (test points)', 'class +1 (test points)', 'final boundary locations $\\phi_i$',
      'decision boundary (p = 0.5)']


def test_perturbation_figure_says_why_sp_and_wn_turn_alike(tmp_path, monkeypatch):
  from experiments.studies import perturbation_2d
  figures = _capture_figures(monkeypatch)
  w, b = perturbation_2d.draw_units(1, 2)
  changes = perturbation_2d.perturbation_changes(w, b, (1e-3,))
  perturbation_2d.plot(changes, (1e-3,), str(tmp_path))
  assert figures['perturbation.png']['title'].endswith('\n' + perturbation_2d.WN_NOTE)
  assert 'SP and WN turn by the same angle' in perturbation_2d.WN_NOTE


def test_robustness_figures_draw_the_init_loss_and_order_the_scales(tmp_path, monkeypatch):
  """lr_<d>.png: the dotted train loss at init lies inside the y range (it is far above the
  trained losses); heatmap_<d>.png: rows x1, x10, N(0,1) from the top."""
  import numpy as np
  from matplotlib import figure
  from experiments.studies import robustness
  figures = _capture_figures(monkeypatch)
  heatmaps = []
  savefig = figure.Figure.savefig

  def keep(fig, path, **kwargs):
    if os.path.basename(str(path)).startswith('heatmap_'):
      heatmaps.append([(ax.get_yticks(), [t.get_text() for t in ax.get_yticklabels()],
                        ax.get_ylim()) for ax in fig.axes if ax.get_images()])
    return savefig(fig, path, **kwargs)

  monkeypatch.setattr(figure.Figure, 'savefig', keep)
  rates, scales = [0.01, 0.1], [1.0, 10.0, robustness.CARELESS]
  cells = [dict(method=m, width=8, lr=lr, scale=s, train_loss=0.1 * (1 + k), train_loss_init=50.0,
                test_metric=0.2, test_metric_se=0.01, test_metric_init=5.0, diverged=False)
           for k, m in enumerate(('sp', 'gmp')) for lr in rates for s in scales]
  analysis = {m: {'best_lr': 0.1} for m in ('sp', 'gmp')}
  robustness.plot('yacht', cells, analysis, ['sp', 'gmp'], rates, scales, [8], 8, 'rmse', 2,
                  str(tmp_path))
  loss = figures['lr_yacht.png']['axes'][1]
  assert loss['ylim'][1] > 50.0, loss['ylim']
  at_init = [label for label, y in loss['lines'] if len(y) == 2 and np.allclose(y, 50.0)]
  assert len(at_init) == 2, loss['lines']  # one dotted line per method
  assert 'train loss at init (method colour)' in loss['legend'], loss['legend']
  for ticks, labels, ylim in heatmaps[0]:
    top_first = [label for _, label in sorted(zip(ticks, labels), reverse=bool(ylim[0] < ylim[1]))]
    assert top_first == ['x1', 'x10', 'N(0,1)'], (top_first, ylim)


def test_quickstart_third_figure_has_a_colorbar_and_short_titles():
  import json
  with open(os.path.join(ROOT, 'colabs', 'quickstart.ipynb'), encoding='utf-8') as f:
    cells = [''.join(c['source']) for c in json.load(f)['cells'] if c['cell_type'] == 'code']
  figures = [c for c in cells if 'plt.subplots' in c]
  for cell in figures[1:3]:  # the heatmaps: training from scratch, the boundaries' points
    assert 'fig.colorbar(' in cell and "layout='constrained'" in cell, cell
  assert "title=f'{name}\\n{inside.sum()}/{len(phi)} points inside the data square'" in \
      figures[2], figures[2]
