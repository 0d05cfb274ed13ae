"""The language_model study: its measures on tiny known cases (LR sensitivity, the attention
logit probe, bits per byte), the methods as `geoparam.nnx.reparameterize` applies them, the
corpus refusals, and the smoke run through `experiments.main` (shared corpus, another file)."""

import gzip
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import main
from experiments.configs import validate
from experiments.studies import language_model as lm
from experiments.studies import robustness
from tests import cli_fork

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.environ.get('GEOPARAM_DATA_DIR') or os.path.join(ROOT, '..', 'shared', 'data')
CORPUS = os.path.join(DATA_DIR, *lm.DEFAULT_CORPUS.split('/'))
needs_corpus = pytest.mark.skipif(not os.path.isfile(CORPUS),
                                  reason=f'{CORPUS} missing (set GEOPARAM_DATA_DIR)')
FIGURES = ('lr_sweep.png', 'lr_sensitivity.png', 'attention_logits.png')
ANCHOR = "The anchor (Wortsman et al. 2023): qk-layernorm lowers SP's LR sensitivity"


def test_bits_per_byte_of_a_uniform_model_is_8_exactly():
  targets = jnp.asarray(np.random.default_rng(0).integers(0, 256, (3, 7)))
  for value in (0.0, 3.7, -120.0):  # equal logits, whatever their value
    assert float(lm.bits_per_byte(jnp.full((3, 7, 256), value), targets)) == 8.0
  # Any logits: the cross-entropy in nats over ln 2.
  logits = np.random.default_rng(1).standard_normal((3, 7, 256)).astype(np.float32) * 3
  x = logits.astype(np.float64)
  lse = np.log(np.exp(x).sum(-1))
  nats = lse - np.take_along_axis(x, np.asarray(targets)[..., None], -1)[..., 0]
  assert float(lm.bits_per_byte(jnp.asarray(logits), targets)) == pytest.approx(
      nats.mean() / math.log(2), rel=1e-5)


def test_lr_sensitivity_on_a_hand_made_grid():
  # Five rates: final losses 3.0, 2.0, 2.5, a diverged cell and 9.0 (above its init of 8.0).
  # Capped at the init (the diverged cell counts as 8.0): 3, 2, 2.5, 8, 8; best 2;
  # sensitivity mean(1, 0, 0.5, 6, 6) = 2.7.
  rates = [1e-3, 1e-2, 0.1, 1.0, 3.0]
  losses = [3.0, 2.0, 2.5, 0.5, 9.0]  # the diverged cell's 0.5 must not count
  cells = [dict(lr=lr, val_loss=v, val_loss_se=0.01, val_loss_init=8.0, diverged=j == 3)
           for j, (lr, v) in enumerate(zip(rates, losses))]
  a = lm.analyze(cells, tolerance=0.3)
  assert a['lr_sensitivity'] == pytest.approx(2.7)
  assert a['lr_sensitivity'] == robustness.sensitivity([3.0, 2.0, 2.5, math.nan, 9.0], 8.0)
  assert a['best_lr'] == 1e-2 and a['best_loss'] == 2.0
  assert a['good_lrs'] == [1e-2, 0.1]  # within 30% of 2.0: 2.0 and 2.5
  assert a['diverged_cells'] == 1 and a['cells'] == 5
  flat = lm.analyze([dict(c, val_loss=2.0, diverged=False) for c in cells], 0.1)
  assert flat['lr_sensitivity'] == 0.0 and len(flat['good_lrs']) == 5


def _numpy_probe(x, wq, wk, heads):
  b, t, d = x.shape
  q = (x @ wq).reshape(b, t, heads, d // heads)
  k = (x @ wk).reshape(b, t, heads, d // heads)
  logits = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(d // heads)
  causal = np.tril(np.ones((t, t), bool))
  return np.abs(logits[..., causal]).max(), np.abs(logits).max()


def test_the_attention_logit_probe_on_a_layer_with_known_weights():
  d, heads = 4, 2
  for seed in range(100):  # known weights whose largest |q.k| is a future pair: the mask matters
    rng = np.random.default_rng(seed)
    wq = rng.standard_normal((d, d)).astype(np.float32)
    wk = rng.standard_normal((d, d)).astype(np.float32)
    x = rng.standard_normal((2, 5, d)).astype(np.float32)
    expected, everywhere = _numpy_probe(x.astype(np.float64), wq, wk, heads)
    if everywhere > expected * 1.1:
      break
  assert everywhere > expected * 1.1
  layer = lm.Attention(d, heads, rngs=nnx.Rngs(0))
  layer.q.kernel[...] = jnp.asarray(wq)
  layer.k.kernel[...] = jnp.asarray(wk)
  _, probe = layer(jnp.asarray(x))
  assert float(probe) == pytest.approx(expected, rel=1e-5)
  q = jnp.asarray((x @ wq).reshape(2, 5, heads, 2))
  k = jnp.asarray((x @ wk).reshape(2, 5, heads, 2))
  assert float(lm.max_attention_logit(q, k)) == pytest.approx(expected, rel=1e-5)
  # By hand on one pair: q = (3, 4), k = (1, 2) in one head of size 2: 11 / sqrt(2).
  q1 = jnp.asarray([[[[3.0, 4.0]]]])
  k1 = jnp.asarray([[[[1.0, 2.0]]]])
  assert float(lm.max_attention_logit(q1, k1)) == pytest.approx(11 / math.sqrt(2))


def _config(**fields):
  from experiments.configs import language_model as config_file  # pylint: disable=g-import-not-at-top
  c = config_file.get_config('smoke')
  for k, v in fields.items():
    c[k] = v
  return c


@pytest.mark.parametrize('where', ['mlp', 'all'])
def test_the_methods_are_applied_by_reparameterize_to_the_selected_layers(where):
  c = _config(where=where)
  key = jax.random.key(0)
  tokens = jnp.asarray(np.arange(2 * c.seq_len).reshape(2, c.seq_len) % 256)
  plain = lm.build('sp', 16, c, key)
  before, _ = plain(tokens)
  for method in ('wn', 'gmp', 'gmp_imn'):
    model = lm.build(method, 16, c, key)
    block = model.blocks[0]
    kinds = {n: type(getattr(block.attn if n in lm.ATTENTION else block, n)).__name__
             for n in lm.ATTENTION + lm.MLP}
    wanted = lm.selected(where)
    assert all(kinds[n].startswith('Reparam[') == (n in wanted) for n in kinds), (method, kinds)
    assert type(model.head).__name__ == 'Linear' and type(model.embed).__name__ == 'Embed'
    assert hasattr(block.mlp_out, 'input_mean_norm') == (method == 'gmp_imn')
    assert not hasattr(block.mlp_in, 'input_mean_norm')
    model.eval()
    after, _ = model(tokens)  # converted from the same initial weights: the same function
    np.testing.assert_allclose(np.asarray(after), np.asarray(before), atol=2e-4)
  qk = lm.build('sp_qk', 16, c, key).blocks[0].attn
  assert qk.q_norm is not None and plain.blocks[0].attn.q_norm is None


def _write(path, data: bytes):
  with open(path, 'wb') as f:
    f.write(data)
  return str(path)


def _text(n_bytes: int) -> bytes:
  line = 'def f(x):  # grüße → λ\n    return x * 2\n'.encode()
  return (line * (n_bytes // len(line) + 1))[:n_bytes]


def test_the_corpus_reads_plain_or_gzipped_and_splits_95_5(tmp_path):
  text = _text(4000)
  plain = lm.load_corpus(_write(tmp_path / 'a.txt', text), 32)
  zipped = lm.load_corpus(_write(tmp_path / 'a.txt.gz', gzip.compress(text)), 32)
  np.testing.assert_array_equal(plain, np.frombuffer(text, np.uint8))
  np.testing.assert_array_equal(zipped, plain)
  train, val = lm.split_corpus(plain)
  assert len(val) == 200 and len(train) == 3800
  np.testing.assert_array_equal(np.concatenate([train, val]), plain)
  windows = lm.val_windows(val, 32, 100)
  assert windows.shape == (100, 33) and windows[-1, -1] == val[-1] and windows[0, 0] == val[0]
  key = jax.random.key(0)
  batch = np.asarray(lm.train_batch(jnp.asarray(train), key, 4, 32))
  again = np.asarray(lm.train_batch(jnp.asarray(train), key, 4, 32))
  np.testing.assert_array_equal(batch, again)  # deterministic from the key
  assert batch.shape == (4, 33) and all(bytes(r) in bytes(train) for r in batch)


BAD = {  # name -> (file contents or None for a missing file, what the one line says)
    'missing': (None, 'no such file'),
    'empty': (b'', 'the file is empty'),
    'not_utf8': (b'abc\n' * 100 + b'\xff\xfe latin-1: \xe9\n' + b'x' * 2000, 'not UTF-8 text'),
    'too_short': (_text(300), 'too short'),
    'broken_gzip': (gzip.compress(_text(5000))[:40], 'broken gzip'),
}


@pytest.mark.parametrize('name', list(BAD))
def test_bad_corpora_fail_in_one_line_naming_the_path_before_any_compile(
    tmp_path, monkeypatch, name):
  contents, says = BAD[name]
  path = str(tmp_path / f'{name}.txt')
  if contents is not None:
    _write(path, contents)
  compiled = []
  monkeypatch.setattr(lm, 'train_cells', lambda *a, **k: compiled.append(a))
  with pytest.raises(validate.ConfigError) as e:
    main.run_study('language_model', str(tmp_path / 'w'), 'smoke', corpus=path)
  message = str(e.value)
  assert says in message and path in message and '\n' not in message, message
  assert not compiled and not (tmp_path / 'w').exists()


def test_the_command_line_refuses_a_bad_corpus_with_exit_2_and_one_line(tmp_path):
  path = _write(tmp_path / 'empty.txt', b'')
  proc = cli_fork.run_main(['--config=experiments/configs/language_model.py:smoke',
                            f'--workdir={tmp_path / "w"}', f'--config.corpus={path}'])
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().count('\n') == 0 and path in proc.stderr, proc.stderr
  assert not (tmp_path / 'w').exists()


@pytest.mark.parametrize('fields, says', [
    (dict(methods='sp,bn'), '--config.methods=sp,bn'),
    (dict(where='attn'), '--config.where=attn'),
    (dict(widths=(16, 24)), 'multiples of head_dim=16'),
    (dict(activation='tanh'), '--config.activation=tanh'),
])
def test_bad_settings_are_refused(tmp_path, fields, says):
  with pytest.raises(validate.ConfigError) as e:
    main.run_study('language_model', str(tmp_path / 'w'), 'smoke', **fields)
  assert says in str(e.value), str(e.value)


def _check_run(workdir, out, methods, widths, rates):
  for name in ('config.json', 'results.json', 'results.csv', 'results.md') + FIGURES:
    assert (workdir / name).is_file(), name
  with open(workdir / 'results.json') as f:
    saved = json.load(f)
  assert saved['claims'] == out['summary']['claims']
  claims = list(saved['claims'])
  assert claims[0].startswith(ANCHOR), claims
  assert all(v.split(' (')[0] in ('holds', 'does not hold', 'not measured: a non-finite result',
                                  'not tested: SP\'s attention logits grew nowhere on this grid')
             for v in saved['claims'].values()), saved['claims']
  for m in methods:
    for w in widths:
      a = saved['analysis'][m][str(w)]
      assert math.isfinite(a['lr_sensitivity']) and a['lr_sensitivity'] >= 0
      assert set(a) >= {'best_lr', 'best_loss', 'good_lrs', 'lr_sensitivity'}
  assert len(saved['cells']) == len(methods) * len(widths) * len(rates)
  cell = saved['cells'][0]
  assert 0 < cell['val_loss_init'] < 12 and len(cell['train_curve']) >= 2
  assert cell['attn_logit_init'] > 0 and math.isfinite(cell['log_z_final'])
  with open(workdir / 'results.csv') as f:
    assert len(f.read().strip().splitlines()) == 1 + len(saved['cells']) * saved['config'][
        'num_seeds']


@needs_corpus
def test_the_smoke_run_through_main_writes_results_figures_and_claims(tmp_path, monkeypatch):
  monkeypatch.setenv('GEOPARAM_DATA_DIR', DATA_DIR)
  out = main.run_study('language_model', str(tmp_path / 'lm'), 'smoke')
  c = _config()
  assert not out['runs'][('gmp', 16)]['state_change'].any()  # no BatchStat without IMN
  _check_run(tmp_path / 'lm', out, ['sp', 'sp_qk', 'gmp'], c.widths, c.learning_rates)
  # Training moved the loss: the best cell is well below the loss at init.
  a = out['summary']['analysis']['sp'][str(c.widths[0])]  # results.json's keys
  cell = out['cells'][0]
  assert a['best_loss'] < cell['val_loss_init'] - 1.0


def test_the_smoke_run_on_another_utf8_file(tmp_path, monkeypatch):
  monkeypatch.delenv('GEOPARAM_DATA_DIR', raising=False)  # the corpus alone, no data directory
  path = _write(tmp_path / 'mine.txt', _text(20000))
  out = main.run_study('language_model', str(tmp_path / 'lm'), 'smoke', corpus=path,
                       methods='sp,sp_qk', widths=(16,))
  _check_run(tmp_path / 'lm', out, ['sp', 'sp_qk'], (16,), _config().learning_rates)
  assert out['summary']['corpus'] == path and out['summary']['val_bytes'] == 1000


def test_gmp_imn_trains_in_the_vmapped_call_on_every_projection():
  # IMN writes its running mean while training (under jax.grad inside the scan and vmap): the
  # smoke config has no GmP+IMN, so it runs here, with where=all and rotary positions.
  c = _config(where='all', num_steps=4, log_every=2, learning_rates=(1e-2,), positions='rotary')
  data = np.frombuffer(_text(20000), np.uint8)
  train, val = lm.split_corpus(data)
  r = lm.train_cells('gmp_imn', 16, [1e-2], c, train, val)
  assert r['val'].shape == (1, 1) and np.isfinite(r['val']).all()
  assert r['train_curve'].shape == (1, 1, 4) and not r['diverged'].any()
  assert r['val'][0, 0] < r['val_init'][0, 0]
  assert r['state_change'][0, 0] > 0  # IMN's running mean moved (carried through the steps)
