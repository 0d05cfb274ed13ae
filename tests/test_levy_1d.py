"""The Levy study end to end: the README's command through the CLI, and its pieces."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.studies import levy_1d
from experiments import main
from experiments.lib import models
from tests import cli_fork


def test_unknown_method_is_a_one_line_error(tmp_path):
  """Through `python -m experiments.main` with the Levy config (the README's first command)."""
  proc = cli_fork.run_main(['--config=experiments/configs/levy_1d.py',
                            f'--workdir={tmp_path / "w"}', '--config.methods=sp,foo'])
  assert proc.returncode == 2
  assert proc.stderr.strip().count('\n') == 0 and 'foo' in proc.stderr, proc.stderr
  assert 'must be distinct comma-separated names among sp, wn' in proc.stderr
  assert not (tmp_path / 'w').exists()
  with pytest.raises(ValueError, match='accepted'):
    models.check_methods(['gmp', 'GmPx'])


# `results.md` of the full protocol in float64, produced by the study before it moved onto
# experiments.lib.protocol (commit 3c9d4df, `python -m experiments.studies.levy_1d --workdir=/tmp/levy_old`,
# 2026-11-24). The port must give it to the printed digits.
EXPECTED_FLOAT64_TABLE = """\
| method | test RMSE (mean +- s.e.) | per seed | epochs run | max log2 max|dphi| |
| --- | --- | --- | --- | --- |
| sp | 1.1437 +- 0.0229 | 1.166, 1.176, 1.055, 1.176, 1.146 | 10000, 10000, 8511, 10000, 10000 | 19.3 |
| wn | 1.2458 +- 0.0363 | 1.284, 1.283, 1.279, 1.101, 1.283 | 7047, 6437, 10000, 10000, 7843 | 0.2 |
| bn | 1.2816 +- 0.0094 | 1.244, 1.291, 1.291, 1.291, 1.291 | 5971, 5010, 6678, 5519, 5817 | 6.5 |
| gmp | **0.8006 +- 0.1542** | 1.155, 1.059, 0.921, 0.414, 0.455 | 8250, 9926, 10000, 10000, 10000 | -1.1 |
"""


def test_the_readme_command_gives_the_stored_float64_table(tmp_path):
  """The README's first command as pasted (the full protocol: 10000 epochs, 5 seeds, 4 methods,
  float64, its figures), through `python -m experiments.main` in a forked child
  (tests/cli_fork.py); ~25 s on 2 cores."""
  workdir = tmp_path / 'levy'
  proc = cli_fork.run_main(['--config=experiments/configs/levy_1d.py', f'--workdir={workdir}'])
  assert proc.returncode == 0, proc.stderr[-3000:]
  md = (workdir / 'results.md').read_text()
  # Digit for digit on the hosts we ran (an Intel Xeon, an AMD EPYC with AVX2) but for GmP's row:
  # with XLA limited to SSE4.2, float64 rounding differs and GmP's chaotic lr-0.1 runs end
  # elsewhere (seeds 3-5 by up to 0.024, mean 0.7950), so that row is compared by what holds:
  # its first two seeds and its epochs exactly, every seed within 0.03.
  want, got = EXPECTED_FLOAT64_TABLE.splitlines(), md.splitlines()[:6]
  assert got[:5] == want[:5], '\n'.join(got)
  gmp_want, gmp_got = ([c.strip() for c in row.split('|')] for row in (want[5], got[5]))
  assert gmp_got[1] == 'gmp' and gmp_got[4] == gmp_want[4], got[5]
  seeds_want, seeds_got = (np.array(r[3].split(', '), float) for r in (gmp_want, gmp_got))
  assert (seeds_got[:2] == seeds_want[:2]).all(), got[5]
  np.testing.assert_allclose(seeds_got, seeds_want, atol=0.03)
  assert '- GmP has the lowest test RMSE: holds (lowest: gmp 0.' in md
  assert '| gmp |' in proc.stdout and 'paper claim' in proc.stdout
  with open(workdir / 'config.json') as f:
    assert json.load(f)['study'] == 'levy_1d'
  with open(workdir / 'results.json') as f:
    summary = json.load(f)
  assert set(summary['test_rmse']) == {'sp', 'wn', 'bn', 'gmp'}
  assert summary['test_rmse']['gmp'] == pytest.approx(0.8006, abs=0.01)  # the table's (see above)
  for m, rmse in summary['test_rmse'].items():
    assert np.isfinite(rmse) and rmse > 0, m
    assert len(summary['per_seed'][m]) == 5 and len(summary['max_abs_dphi_per_seed'][m]) == 5, m
  assert any('GmP has the lowest' in k for k in summary['claims'])
  for m in ('sp', 'gmp'):
    spectra = summary['spectra_seed0'][m]
    assert spectra['steps'][0] == 0 and len(spectra['phi'][0]) == 100
  for name in ('results.csv', 'predictions.png', 'boundary_change.png', 'location_spectra.png'):
    assert (workdir / name).stat().st_size > 0, name


def test_data_follows_protocol():
  data = levy_1d.make_data(0, np.float64)
  assert data['x_train'].shape == (50, 1) and data['y_train'].shape == (50, 1)
  assert np.all(np.abs(data['x_train']) <= 10)
  np.testing.assert_allclose(np.diff(data['x_test'][:, 0]), 0.1, atol=1e-12)
  assert data['x_test'][0, 0] == -10 and data['x_test'][-1, 0] == 10
  noise = data['y_train'] - levy_1d.levy(data['x_train'])
  assert 0.05 < noise.std() < 0.2  # sigma 0.1
  # Levy has its global minimum 0 at x = 1.
  assert abs(levy_1d.levy(np.array(1.0))) < 1e-12
  np.testing.assert_array_equal(levy_1d.make_data(0, np.float64)['y_train'], data['y_train'])


@pytest.mark.parametrize('method', ['sp', 'wn', 'wn_mbn', 'bn', 'gmp'])
def test_boundary_points_are_where_the_preactivation_vanishes(method):
  """phi from the parameters must zero the hidden pre-activation (independent check via the model)."""
  with jax.enable_x64(True):
    data = levy_1d.make_data(1, np.float64)
    x = jnp.asarray(data['x_train'])
    model = models.MLP(hidden=(7,), out=1, method=method, param_dtype=jnp.float64)
    variables = model.init(jax.random.key(3), x, train=False)
    # Give biases/lam non-zero values so the points are not all at 0.
    variables = jax.tree_util.tree_map_with_path(
        lambda p, v: v + 0.3 if any(getattr(k, 'key', None) in ('bias', 'lam') for k in p) else v,
        variables)
    phi = levy_1d.boundary_points(method, variables, x)

    # Unit i's pre-activation at x = phi_i, normalized with x's batch statistics.
    for i in range(7):
      probe = jnp.concatenate([x, jnp.full((1, 1), phi[i])])
      pre = _hidden_preactivation(model, variables, probe, x, method)
      assert abs(float(pre[-1, i])) < 1e-8 * (1 + float(jnp.max(jnp.abs(pre)))), (method, i)


def _hidden_preactivation(model, variables, probe, x, method):
  """Pre-activation of the hidden layer on `probe`, normalized with the statistics of `x`."""
  p = variables['params']
  if method == 'sp':
    return probe @ p['hidden_0']['kernel'] + p['hidden_0']['bias']
  if method in ('wn', 'wn_mbn'):
    v = p['hidden_0']['kernel']
    g = p['hidden_0_wn']['hidden_0/kernel/scale']
    h = probe @ (g * v / jnp.linalg.norm(v, axis=0))
    if method == 'wn':
      return h + p['hidden_0']['bias']
    hx = x @ (g * v / jnp.linalg.norm(v, axis=0))
    return h - hx.mean(0) + p['hidden_0_mbn']['bias']
  if method == 'bn':
    k = p['hidden_0']['kernel']
    hx = x @ k
    bn = p['hidden_0_bn']
    return (probe @ k - hx.mean(0)) / jnp.sqrt(hx.var(0) + 1e-3) * bn['scale'] + bn['bias']
  g = p['hidden_0']
  return probe * jnp.sign(g['sign']) + g['lam']


def test_tracked_boundary_changes_match_the_recorded_points(tmp_path):
  """max_dphi per epoch is max_i |phi_{i,t+1} - phi_{i,t}| of the points recorded in the scan."""
  out = main.run_study('levy_1d', str(tmp_path), methods=['bn'], num_epochs=25, num_seeds=2,
                       hidden=6, stop_patience=5, plateau_patience=3, plots=False)
  data = levy_1d.make_data(0, np.float64)
  for m, r in out['results'].items():
    locs = r['locations']  # (seeds, epochs + 1, hidden)
    assert locs.shape == (2, 26, 6)
    expected = np.max(np.abs(np.diff(locs, axis=1)), axis=2)
    active = r['trace']['active']
    np.testing.assert_allclose(r['trace']['max_dphi'][active], expected[active], rtol=1e-12)
    assert np.all(np.isnan(r['trace']['max_dphi'][~active]))
    # Index 0 is the initialization (BN: phi = mean(x) / w, not 0): the fresh model's points.
    with jax.enable_x64(True):
      model = models.MLP(hidden=(6,), out=1, method=m, gmp_glorot_scale=True,
                         param_dtype=jnp.float64)
      keys = jax.random.split(jax.random.key(0), 2)
      variables = model.init(keys[1], jnp.asarray(data['x_train']), train=False)
      phi0 = levy_1d.boundary_points(m, variables, jnp.asarray(data['x_train']))
    np.testing.assert_allclose(locs[1, 0], phi0, rtol=1e-12, atol=1e-300)


def test_a_diverged_run_never_holds(tmp_path):
  """lr 1e30 in float32: every RMSE is inf or NaN, so no claim gets a verdict."""
  out = main.run_study('levy_1d', str(tmp_path), 'smoke', methods='sp,gmp', num_epochs=40,
                       lr_gmp=1e30, lr_others=1e30, float64=False, plots=False)
  claims = out['summary']['claims']
  assert not np.all(np.isfinite(out['summary']['per_seed']['gmp']))
  assert claims and all(v.startswith('not measured: a non-finite result') for v in claims.values())
