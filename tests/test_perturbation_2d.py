"""The perturbation study (Fig. 1 b-e) and the appendix A boundary figures."""

import json
import re

import numpy as np
import pytest

from experiments.studies import activation_boundaries
from experiments import main
from experiments.studies import perturbation_2d
from experiments.configs import validate
from tests import cli_fork


def test_reference_unit_is_the_notebooks_draw():
  w, b = perturbation_2d.draw_units(1, 3)
  rng = np.random.RandomState(1)  # np.random.seed(1); randn(2) * 1e-3; randn(1) * 1e-3
  np.testing.assert_array_equal(w[0], rng.randn(2) * 1e-3)
  assert b[0] == rng.randn(1)[0] * 1e-3


def test_changes_follow_eq_12_and_theorem_3():
  w, b = perturbation_2d.draw_units(3, 200)
  eps_values = (1e-4, 1e-2)
  changes = perturbation_2d.perturbation_changes(w, b, eps_values)
  for eps in eps_values:
    # SP: eq. (12) with the arccos formula, computed here independently.
    wp = w + eps
    cos = np.sum(w * wp, 1) / np.linalg.norm(w, axis=1) / np.linalg.norm(wp, axis=1)
    np.testing.assert_allclose(changes['sp'][eps]['angle_deg'],
                               np.degrees(np.arccos(np.clip(cos, -1, 1))), atol=1e-5)
    # WN: eq. (14), the same direction change as SP.
    np.testing.assert_allclose(changes['wn'][eps]['angle_deg'], changes['sp'][eps]['angle_deg'],
                               rtol=1e-9, atol=1e-9)
    # GmP in R^2: exactly eps radians (Theorem 3 with equality).
    np.testing.assert_allclose(changes['gmp'][eps]['angle_deg'], np.degrees(eps), rtol=1e-8)
    # SP location after the perturbation: -(b + eps)(w + eps) / |w + eps|^2.
    expected = -(b + eps)[:, None] * wp / np.sum(wp ** 2, 1, keepdims=True)
    np.testing.assert_allclose(changes['sp'][eps]['phi_after'], expected, rtol=1e-9)
  # Before the perturbation the three parameterizations describe the same boundary.
  np.testing.assert_allclose(changes['gmp'][1e-4]['phi_before'], changes['sp'][1e-4]['phi_before'],
                             rtol=1e-9)


def test_study_writes_its_files_and_states_the_claims(tmp_path):
  out = main.run_study('perturbation_2d', str(tmp_path), 'smoke')
  summary = json.loads((tmp_path / 'results.json').read_text())
  assert summary == out['summary']
  assert (tmp_path / 'perturbation.png').stat().st_size > 0
  assert set(summary['unit']['changes']) == {'sp', 'wn', 'gmp'}
  assert set(summary['unit']['changes']['gmp']) == {'0.0001', '0.001', '0.01', '0.1'}
  verdicts = list(summary['claims'].values())
  assert verdicts[0].startswith('holds')  # Theorem 3's bound
  assert all(v.startswith('holds') for v in verdicts), verdicts
  assert summary['over_draws']['sp']['0.001']['median_angle_deg'] > 10
  assert out['changes']['gmp'][0.1]['angle_deg'].shape == (50,)
  with open(tmp_path / 'results.csv') as f:
    assert len(f.readlines()) == 1 + 3 * 4 * 50  # header + method x eps x draw
  # The drawn unit is unit 0 of the draws: its angles equal eq. (12) computed here.
  w, b = np.asarray(summary['unit']['w']), summary['unit']['b']
  cos = w @ (w + 1e-3) / np.linalg.norm(w) / np.linalg.norm(w + 1e-3)
  np.testing.assert_allclose(summary['unit']['changes']['sp']['0.001']['angle_deg'],
                             np.degrees(np.arccos(cos)), rtol=1e-9)
  assert b == perturbation_2d.draw_units(1, 1)[1][0]


@pytest.mark.parametrize('field, value, message', [
    ('eps', (0.0, 1e-3), 'eps=(0.0, 0.001): must be a tuple of finite numbers > 0'),
    ('eps', (), 'must be a tuple of finite numbers > 0'),
    ('num_draws', 0, 'num_draws=0: must be an int >= 1'),
    ('weight_scale', -1.0, 'weight_scale=-1.0: must be a finite number > 0'),
])
def test_bad_settings_are_refused_before_any_work(tmp_path, field, value, message):
  with pytest.raises(validate.ConfigError, match=re.escape(message)):
    main.run_study('perturbation_2d', str(tmp_path / 'out'), **{field: value})
  assert not (tmp_path / 'out').exists()


def test_cli(tmp_path):
  """The module still runs as a script (the config file's command through experiments.main)."""
  proc = cli_fork.run_main(  # python -m experiments.main in a forked child (tests/cli_fork.py)
      ['--config=experiments/configs/perturbation_2d.py', f'--workdir={tmp_path}',
       '--config.num_draws=20', '--config.plots=False'])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'paper claim' in proc.stdout
  assert (tmp_path / 'results.json').exists() and not (tmp_path / 'perturbation.png').exists()
  proc = cli_fork.run_main(  # python -m experiments.main in a forked child (tests/cli_fork.py)
      ['--config=experiments/configs/perturbation_2d.py', f'--workdir={tmp_path / "bad"}',
       '--config.eps=(-1.0,)'])
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1].endswith('must be a tuple of finite numbers > 0, '
                                                       'e.g. "(1e-3,1e-1)".'), proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
  assert not (tmp_path / 'bad').exists()


def test_activation_boundaries_figures(tmp_path):
  summary = main.run_study('activation_boundaries', str(tmp_path), 'smoke')['summary']
  assert summary['max_abs_preactivation_at_phi'] < 1e-12
  assert list(summary['claims'].values())[0].startswith('holds')
  # In R the point is -lam * sign: theta = pi flips it.
  r1 = {(r['lam'], round(r['theta'], 6)): r['phi'][0] for r in summary['r1']}
  assert r1[(1.0, 0.0)] == -1.0 and r1[(1.0, round(np.pi, 6))] == 1.0
  r2 = summary['r2'][0]
  np.testing.assert_allclose(r2['phi'], [-np.sqrt(0.5), -np.sqrt(0.5)], rtol=1e-12)
  for name in ('results.json', 'results.csv', 'results.md', 'boundaries_1d.png',
               'boundaries_2d.png'):
    assert (tmp_path / name).stat().st_size > 0
  with pytest.raises(ValueError, match='0 or pi'):
    activation_boundaries.unit_params(1.0, np.pi / 2, 1)
