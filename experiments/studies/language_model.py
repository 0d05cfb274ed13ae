r"""Learning-rate sensitivity of a small byte-level transformer, per method and width.

The command and the defaults are in `experiments/configs/language_model.py`. The yardstick is
Wortsman et al. 2023 (arXiv 2309.14322): over a grid of learning rates, the *LR sensitivity*
of the final loss (`robustness.sensitivity`: the mean over the rates of `min(loss(lr), loss at
init) - best loss`, a diverged cell counting as its loss at init), the growth of the attention
logits (qk-layernorm fixes it) and the divergence of the output logits (z-loss fixes it).

Data: the bytes of a UTF-8 text file (`corpus`, gzipped or not; by default
`text/python-docs-3.11.txt.gz` of the data directory), vocabulary 256, no tokenizer. The first
95% trains, the last 5% validates. Training batches are `batch_size` windows of `seq_len + 1`
bytes at uniform random offsets of the training split, drawn from the seed's key and the step
(the same batches at every rate, other batches per seed); the validation loss is the mean over
`val_sequences` fixed, evenly spaced windows of the validation split.

The model (`Transformer`, NNX): a byte embedding, learned positions (or rotary ones in every
attention layer), `depth` pre-LayerNorm blocks (causal multi-head attention of `width //
head_dim` heads; an MLP `width -> mlp_ratio * width -> width`, ReLU or GELU), a final
LayerNorm and an untied output projection to 256 logits. Attention projections have no bias,
as in Wortsman et al.; the MLP projections have biases (GmP's `lam`: a bias-free layer has
none); LayerNorms have a scale and no bias. `qk_norm` puts a LayerNorm (per head) on the
queries and the keys. Heads and depth: `width // head_dim` heads, `depth` blocks at every
width.

Methods, applied the way a user would: the plain model goes through
`geoparam.nnx.reparameterize(model, method, where=...)` (from its initial weights, exactly).
`sp`: the plain model; `sp_qk`: the plain model with qk-layernorm; `wn`, `gmp`: the method on
the selected projections (`where`: `mlp`, the two MLP projections; `all`: q, k, v, out and
the MLP projections; the embedding and the output projection stay plain); `gmp_imn`: GmP
on the selected projections, with IMN (input mean normalization) on the MLP's down-projection,
whose inputs are the non-negative ReLU outputs (paper 002 puts IMN on the layers after a
ReLU). IMN's running mean updates in training mode and is used for the validation loss.

Training: AdamW (0.9, 0.95, eps 1e-8) after clipping the gradient's global norm at
`clip_norm`, a linear warmup over `warmup_fraction` of the steps and a cosine decay to 0
(`s(t)`), and independent weight decay (`p <- p - s(t) * (lr * adam(g) + weight_decay * p)`,
on the leaves `geoparam.masks.decay_mask` decays: kernels and WN's directions, not GmP's
angles, gains, biases or norms); the loss is the byte cross-entropy plus `z_loss * log^2 Z`.
The rates x seeds of one (method, width) are the members of ONE compiled call: the model is
split (`nnx.split`) into a state per seed, and a pure training function of (state, rate, key)
is vmapped over the members.

Per member, the measures: the validation loss in bits per byte (`bits_per_byte`) at init and
at the end; the training loss per step (bits per byte, without the z-loss); per step, the max
attention logit (`max_attention_logit`: the largest `|q_i . k_j| / sqrt(head_dim)` over the
causal pairs, heads, layers and the batch) and the output's log Z (the mean over tokens of
`logsumexp` of the logits). A member has *diverged* (`robustness.diverged`) when its training
loss was not finite at some step, or its final training loss (mean of the last `log_every`
steps) is not finite or above `diverge_factor` times its initial one (step 0's). A cell is one
(method, width, rate): means and standard errors over the seeds; diverged when any seed is.

Per (method, width): the best rate (lowest mean validation loss among cells with no diverged
seed), its loss, the rates within `good_tolerance` (10%) of it, and `lr_sensitivity`
(`robustness.sensitivity` of the cells' mean final validation loss, capped at their mean
initial validation loss).

Writes to `workdir`: results.json (every cell with its curves; per (method, width) the
statistics; the claims; wall times and tokens/s), results.csv (one row per member),
results.md, `lr_sweep.png` (validation loss against the rate, a panel per width, s.e. bands,
diverged cells marked), `lr_sensitivity.png` (against the width) and `attention_logits.png`
(max attention logit over training against the rate).
"""

from __future__ import annotations

import functools
import gzip
import math
import os
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from experiments.configs import validate
from experiments.lib import plotting, report
from experiments.studies import robustness
import geoparam
import geoparam.nnx  # pylint: disable=unused-import (geoparam.nnx.reparameterize)

# The study's methods: name -> (the library method applied by reparameterize, or None for the
# plain model; qk-layernorm on). A method with IMN gets it on the down-projection alone.
METHODS = {'sp': (None, False), 'sp_qk': (None, True), 'wn': ('wn', False),
           'gmp': ('gmp', False), 'gmp_imn': ('gmp_imn', False)}
WHERE = ('mlp', 'all')
ACTIVATIONS = ('relu', 'gelu')
POSITIONS = ('learned', 'rotary')
DEFAULT_CORPUS = 'text/python-docs-3.11.txt.gz'  # in the data directory
VAL_FRACTION = 0.05  # the last 5% of the bytes validates
VOCAB = 256
LOG2E = 1.0 / math.log(2.0)
ATTENTION = ('q', 'k', 'v', 'out')
MLP = ('mlp_in', 'mlp_out')
LABELS = {'sp_qk': 'SP+qk-norm'}
GROWTH = 10.0  # attention logits "grow": their max over training above this x step 0's


def label(method: str) -> str:
  """The name of `method` in figures: `'sp_qk'` -> `'SP+qk-norm'`, else `plotting.method_label`.

  >>> [label(m) for m in METHODS]
  ['SP', 'SP+qk-norm', 'WN', 'GmP', 'GmP+IMN']
  """
  return LABELS.get(method, plotting.method_label(method))


# ---------------------------------------------------------------------------
# Config rules and data.


def _widths(v, config):
  validate.int_tuple(1)(v, config)
  if len(set(v)) != len(v):
    raise validate.Bad('must be distinct ints >= 1')
  head = config.get('head_dim')
  if isinstance(head, int) and any(w % head for w in v):
    raise validate.Bad(f'must be multiples of head_dim={head} (heads = width // head_dim)')


def _head_dim(v, config):
  validate.integer(1)(v, config)
  if config.get('positions') == 'rotary' and v % 2:
    raise validate.Bad('must be even with rotary positions (pairs of coordinates rotate)')


CONFIG_RULES = {'corpus': validate.optional_str,
                'methods': validate.names_list(METHODS),
                'where': validate.choice(WHERE),
                'widths': _widths, 'head_dim': _head_dim,
                'mlp_ratio': validate.integer(1),
                'activation': validate.choice(ACTIVATIONS),
                'positions': validate.choice(POSITIONS),
                'qk_norm': validate.boolean, 'z_loss': validate.real(0.0),
                'learning_rates': validate.distinct_positive_reals,
                'num_steps': validate.integer(1), 'seq_len': validate.integer(1),
                'clip_norm': validate.real(0.0, open_low=True),
                'val_sequences': validate.integer(1), 'quick_compile': validate.boolean,
                'diverge_factor': validate.real(1.0), 'good_tolerance': validate.real(0.0)}


class CorpusError(validate.ConfigError):
  """A corpus that cannot be read as it is: one line naming the path and what is wrong."""


def corpus_path(c) -> tuple[str, str]:
  """`(path of the corpus, the flag that named it)`: `corpus`, else `DEFAULT_CORPUS` in
  `data_dir` (else `$GEOPARAM_DATA_DIR`). Raises `CorpusError` when neither is given."""
  if c.get('corpus'):
    return os.path.expanduser(c.corpus), f'--config.corpus={c.corpus}'
  root = c.get('data_dir') or os.environ.get('GEOPARAM_DATA_DIR')
  if not root:
    raise CorpusError(f'--config.corpus=None: no corpus and no data directory (no '
                      f'--config.data_dir, no $GEOPARAM_DATA_DIR) to find the default '
                      f'{DEFAULT_CORPUS} in; pass --config.data_dir=DIR (the folder holding '
                      'text/) or --config.corpus=FILE (any UTF-8 text file).')
  flag = (f'--config.data_dir={c.data_dir}' if c.get('data_dir') else
          f'$GEOPARAM_DATA_DIR={root}')
  return os.path.join(os.path.expanduser(root), *DEFAULT_CORPUS.split('/')), flag


def min_bytes(seq_len: int) -> int:
  """The shortest corpus: its last 5% (validation) holds one window of `seq_len + 1` bytes.

  >>> min_bytes(64)
  1300
  """
  return int(math.ceil((seq_len + 1) / VAL_FRACTION))


@functools.lru_cache(maxsize=2)
def _read(path: str, size: int, mtime: float) -> bytes:
  """The bytes of `path` (gunzipped when it starts with gzip's magic), checked to be UTF-8."""
  del size, mtime  # the cache key: a changed file is read again
  with open(path, 'rb') as f:
    raw = f.read()
  if raw[:2] == b'\x1f\x8b':
    try:
      raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
      raise CorpusError(f'{path}: a broken gzip file ({e}); give a complete file.') from None
  if not raw:
    raise CorpusError(f'{path}: the file is empty; a corpus is a UTF-8 text file.')
  try:
    raw.decode('utf-8')
  except UnicodeDecodeError as e:
    raise CorpusError(f'{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); '
                      'a corpus is a UTF-8 text file, gzipped or not.') from None
  return raw


def load_corpus(path: str, seq_len: int, flag: str | None = None) -> np.ndarray:
  """The bytes of the text file `path` as uint8 `(n,)` (gzipped files are decompressed).

  Raises `CorpusError` (one line, naming the path and `flag`) for a missing file, an empty
  one, one that is not UTF-8 text, and one shorter than `min_bytes(seq_len)`.
  """
  where = f'{flag}: ' if flag and not flag.endswith(path) else ''
  if not os.path.isfile(path):
    what = 'is a directory, not a file' if os.path.isdir(path) else 'no such file'
    raise CorpusError(f'{where}{path}: {what}; a corpus is a UTF-8 text file, gzipped or not.')
  st = os.stat(path)
  try:
    raw = _read(path, st.st_size, st.st_mtime)
  except CorpusError as e:
    raise CorpusError(f'{where}{e}') from None
  need = min_bytes(seq_len)
  if len(raw) < need:
    raise CorpusError(f'{where}{path}: {len(raw)} bytes, too short for seq_len={seq_len}: needs '
                      f'at least {need} (its last 5%, the validation split, must hold one window '
                      f'of {seq_len + 1} bytes).')
  return np.frombuffer(raw, np.uint8)


def check_data(config) -> None:
  """Raises `validate.ConfigError` (one line) unless the corpus reads as the run will read it."""
  path, flag = corpus_path(config)
  load_corpus(path, config.seq_len, flag)


def split_corpus(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`(train, validation)`: the first 95% and the last 5% of `data`, contiguous.

  >>> [len(p) for p in split_corpus(np.zeros(100, np.uint8))]
  [95, 5]
  """
  cut = len(data) - int(round(VAL_FRACTION * len(data)))
  return data[:cut], data[cut:]


def val_windows(val: np.ndarray, seq_len: int, count: int) -> np.ndarray:
  """`(m, seq_len + 1)` evenly spaced windows of `val`, `m = min(count, what fits)`.

  >>> val_windows(np.arange(10, dtype=np.uint8), 3, 2)
  array([[0, 1, 2, 3],
         [6, 7, 8, 9]], dtype=uint8)
  """
  last = len(val) - seq_len - 1
  m = max(1, min(count, last + 1))
  starts = np.linspace(0, last, m).round().astype(np.int64)
  return val[starts[:, None] + np.arange(seq_len + 1)]


def train_batch(train: jax.Array, key: jax.Array, batch_size: int, seq_len: int) -> jax.Array:
  """`(batch_size, seq_len + 1)` windows of `train` at uniform random offsets drawn from `key`."""
  starts = jax.random.randint(key, (batch_size,), 0, train.shape[0] - seq_len)
  return train[starts[:, None] + jnp.arange(seq_len + 1)]


# ---------------------------------------------------------------------------
# Measures.


def bits_per_byte(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean cross-entropy in bits of `logits (..., 256)` at integer `targets (...)`.

  Computed in base 2 (`log2 sum exp(l - max) + (max - l_target) log2 e`), so a uniform model
  (equal logits) gives exactly `log2 256 = 8`.
  """
  top = jnp.max(logits, axis=-1, keepdims=True)
  total = jnp.sum(jnp.exp(logits - top), axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)
  return jnp.mean(jnp.log2(total) + (top - picked)[..., 0] * LOG2E)


def attention_logits(q: jax.Array, k: jax.Array) -> jax.Array:
  """The logits softmax sees: `q (b, t, h, dh)`, `k (b, t, h, dh)` -> `(b, h, t, t)`,
  `q_i . k_j / sqrt(dh)`."""
  return jnp.einsum('bqhd,bkhd->bhqk', q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))


def causal_mask(t: int) -> jax.Array:
  """`(t, t)` bool, True where query `i` may attend to key `j` (`j <= i`)."""
  return jnp.tril(jnp.ones((t, t), bool))


def max_attention_logit(q: jax.Array, k: jax.Array) -> jax.Array:
  """The largest `|q_i . k_j| / sqrt(dh)` over the causal pairs `j <= i`, heads and batch."""
  logits = attention_logits(q, k)
  return jnp.max(jnp.where(causal_mask(q.shape[1]), jnp.abs(logits), 0.0))


# ---------------------------------------------------------------------------
# The model.


def rotary(x: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotary positions: `x (b, t, h, dh)` with coordinate pairs `(i, i + dh/2)` rotated by
  `position * base^(-2i/dh)`."""
  t, dh = x.shape[1], x.shape[-1]
  freq = base ** (-jnp.arange(dh // 2, dtype=jnp.float32) * 2 / dh)
  angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq  # (t, dh/2)
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  a, b = x[..., :dh // 2], x[..., dh // 2:]
  return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  """Causal multi-head self-attention, no biases; `(b, t, d) -> ((b, t, d), max logit)`."""

  def __init__(self, width: int, heads: int, *, qk_norm: bool = False, rotary: bool = False,
               rngs: nnx.Rngs):
    self.heads, self.use_rotary = heads, rotary
    self.q, self.k, self.v, self.out = (nnx.Linear(width, width, use_bias=False, rngs=rngs)
                                        for _ in range(4))
    dh = width // heads
    self.q_norm = nnx.LayerNorm(dh, use_bias=False, rngs=rngs) if qk_norm else None
    self.k_norm = nnx.LayerNorm(dh, use_bias=False, rngs=rngs) if qk_norm else None

  def __call__(self, x):
    b, t, d = x.shape
    split = lambda y: y.reshape(b, t, self.heads, d // self.heads)
    q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    if self.use_rotary:
      q, k = rotary(q), rotary(k)
    logits = attention_logits(q, k)
    mask = causal_mask(t)
    probe = jnp.max(jnp.where(mask, jnp.abs(jax.lax.stop_gradient(logits)), 0.0))
    weights = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(logits.dtype).min), axis=-1)
    y = jnp.einsum('bhqk,bkhd->bqhd', weights, v).reshape(b, t, d)
    return self.out(y), probe


class Block(nnx.Module):
  """A pre-LayerNorm block: `x + attn(ln(x))`, then `x + mlp_out(act(mlp_in(ln(x))))`."""

  def __init__(self, width: int, heads: int, mlp_ratio: int, activation: str, qk_norm: bool,
               rotary: bool, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(width, use_bias=False, rngs=rngs)
    self.attn = Attention(width, heads, qk_norm=qk_norm, rotary=rotary, rngs=rngs)
    self.ln2 = nnx.LayerNorm(width, use_bias=False, rngs=rngs)
    self.mlp_in = nnx.Linear(width, mlp_ratio * width, rngs=rngs)
    self.mlp_out = nnx.Linear(mlp_ratio * width, width, rngs=rngs)
    self.activation = activation

  def __call__(self, x):
    y, probe = self.attn(self.ln1(x))
    x = x + y
    act = nnx.relu if self.activation == 'relu' else nnx.gelu
    return x + self.mlp_out(act(self.mlp_in(self.ln2(x)))), probe


class Transformer(nnx.Module):
  """A byte-level decoder-only transformer: `bytes (b, t) int -> (logits (b, t, 256), max
  attention logit over the layers)`."""

  def __init__(self, width: int, depth: int, heads: int, seq_len: int, *, mlp_ratio: int = 4,
               activation: str = 'relu', qk_norm: bool = False, positions: str = 'learned',
               rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, width, rngs=rngs)
    self.pos = (nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, width)))
                if positions == 'learned' else None)
    self.blocks = nnx.List([Block(width, heads, mlp_ratio, activation, qk_norm,
                                  positions == 'rotary', rngs) for _ in range(depth)])
    self.ln_f = nnx.LayerNorm(width, use_bias=False, rngs=rngs)
    self.head = nnx.Linear(width, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    if self.pos is not None:
      x = x + self.pos[...][:tokens.shape[1]]
    probes = []
    for block in self.blocks:
      x, probe = block(x)
      probes.append(probe)
    return self.head(self.ln_f(x)), jnp.max(jnp.stack(probes))


def selected(where: str) -> tuple[str, ...]:
  """The names of the projections a method applies to (`where`: 'mlp' or 'all')."""
  return MLP if where == 'mlp' else ATTENTION + MLP


def build(method: str, width: int, c, key: jax.Array) -> Transformer:
  """The plain model of config `c` at `width` (initialized from `key`), with `method` applied
  as a user would: `geoparam.nnx.reparameterize` on the projections `where` selects."""
  record, qk_norm = METHODS[method]
  model = Transformer(width, c.depth, width // c.head_dim, c.seq_len, mlp_ratio=c.mlp_ratio,
                      activation=c.activation, qk_norm=c.qk_norm or qk_norm,
                      positions=c.positions, rngs=nnx.Rngs(params=key))
  if record is None:
    return model
  record, names = geoparam.methods.get(record), selected(c.where)
  if record.imn is not None:  # IMN on the down-projection (after a ReLU), not elsewhere
    first = [n for n in names if n != 'mlp_out']
    if first:
      model = geoparam.nnx.reparameterize(model, record._replace(imn=None),
                                          where=lambda _, p: p[-1] in first)
    return geoparam.nnx.reparameterize(model, record, where=lambda _, p: p[-1] == 'mlp_out')
  return geoparam.nnx.reparameterize(model, record, where=lambda _, p: p[-1] in names)


def count_params(state) -> int:
  return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(state)))


# ---------------------------------------------------------------------------
# Training.


def schedule(num_steps: int, warmup_fraction: float):
  """`s(t)`: linear warmup to 1 over `warmup_fraction` of the steps, then cosine to 0."""
  warmup = max(1, int(round(warmup_fraction * num_steps)))
  return optax.warmup_cosine_decay_schedule(0.0, 1.0, warmup, max(num_steps, warmup + 1), 0.0)


def optimizer(lr, c, params) -> optax.GradientTransformation:
  """AdamW (0.9, 0.95, eps 1e-8) after global-norm clipping, schedule `s(t)`, and independent
  weight decay: the update is `-s(t) * (lr * adam + weight_decay * p)` on the leaves
  `geoparam.masks.decay_mask` decays (`lr` may be traced)."""
  names = lambda path: [n for n in path if n != 'value']  # nnx.State paths end in 'value'
  mask = geoparam.masks.decay_mask_by(
      params, lambda path, _: names(path)[-1] in geoparam.masks.DECAYED_NAMES)
  s = schedule(c.num_steps, c.warmup_fraction)
  return optax.chain(optax.clip_by_global_norm(c.clip_norm),
                     optax.scale_by_adam(0.9, 0.95, 1e-8),
                     optax.add_decayed_weights(c.weight_decay / lr, mask),
                     optax.scale_by_schedule(lambda t: -lr * s(t)))


def make_train(graphdef, eval_graphdef, c, train_data, val_data):
  """`train(params, rest, lr, key) -> dict` of one member (see `train_cells`): pure, so it
  vmaps over members."""
  def loss_fn(params, rest, tokens):
    # Fresh Variables at this trace level: IMN writes its running mean into `rest`'s BatchStat
    # in training mode, and NNX refuses to mutate a Variable made outside `jax.grad`.
    rest = jax.tree.map(lambda x: x, rest)
    model = nnx.merge(graphdef, params, rest)
    logits, probe = model(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    log_z = jax.nn.logsumexp(logits, axis=-1)
    loss = jnp.mean(ce) + c.z_loss * jnp.mean(log_z ** 2)
    _, _, new_rest = nnx.split(model, nnx.Param, ...)
    return loss, (new_rest, jnp.mean(ce) * LOG2E, probe, jnp.mean(log_z))

  def val_loss(params, rest):
    logits, _ = nnx.merge(eval_graphdef, params, rest)(val_data[:, :-1])
    return bits_per_byte(logits, val_data[:, 1:])

  def train(params, rest, lr, key):
    opt = optimizer(lr, c, params)
    initial = (params, rest)

    def step(carry, t):
      params, rest, opt_state = carry
      tokens = train_batch(train_data, jax.random.fold_in(key, t), c.batch_size, c.seq_len)
      grads, (rest, bits, probe, log_z) = jax.grad(loss_fn, has_aux=True)(params, rest, tokens)
      updates, opt_state = opt.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), rest, opt_state), (bits, probe, log_z)

    (params, rest, _), (bits, probe, log_z) = jax.lax.scan(
        step, (params, rest, opt.init(params)), jnp.arange(c.num_steps))
    # Both validation losses in one vmapped evaluation (one copy of the net to compile).
    both = jax.tree.map(lambda a, b: jnp.stack([a, b]), initial, (params, rest))
    val = jax.vmap(val_loss)(*both)
    moved = [jnp.max(jnp.abs(a - b)) for a, b in zip(jax.tree.leaves(initial[1]),
                                                     jax.tree.leaves(rest))]
    return dict(val_init=val[0], val=val[1], train_curve=bits, attn_logit=probe, log_z=log_z,
                state_change=jnp.max(jnp.stack(moved)) if moved else jnp.zeros(()))

  return train


def member_keys(seed: int, num_seeds: int) -> tuple[jax.Array, jax.Array]:
  """`(init keys, data keys)`, each `(num_seeds, 2)`; seed `i`'s depend only on `(seed, i)`."""
  keys = robustness.seed_keys(seed, num_seeds)
  both = jax.vmap(lambda k: jax.random.split(k, 2))(keys)
  return both[:, 0], both[:, 1]


def train_cells(method: str, width: int, rates: Sequence[float], c, train_data, val_data
                ) -> dict[str, Any]:
  """Trains every rate for every seed in ONE compiled, vmapped call.

  Returns arrays shaped `(rates, seeds)`: `val`, `val_init` (bits per byte), `state_change`
  (the largest change of a non-parameter variable in training: IMN's running mean), `train_final`,
  `train_init`, `nonfinite`, `diverged`, `attn_logit_init`, `attn_logit_max`, `log_z_final`,
  `log_z_max_abs`; `(rates, seeds, steps)`: `train_curve`, `attn_logit`, `log_z`; and
  `params` (the count), `seconds`, `tokens_per_second`.
  """
  init_keys, data_keys = member_keys(c.seed, c.num_seeds)
  states = []
  for k in init_keys:  # the user's path: build the plain model, reparameterize it
    model = build(method, width, c, k)
    model.eval()
    eval_graphdef = nnx.graphdef(model)
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    states.append((params, rest))
  stack = lambda *xs: jnp.stack(xs)
  params, rest = jax.tree.map(stack, *states)
  r, s = len(rates), c.num_seeds
  tile = lambda x: jnp.tile(x, (r,) + (1,) * (x.ndim - 1))  # member i: rate i // s, seed i % s
  params, rest = jax.tree.map(tile, params), jax.tree.map(tile, rest)
  lrs = jnp.repeat(jnp.asarray(rates, jnp.float32), s)
  keys = tile(data_keys)
  train = make_train(graphdef, eval_graphdef, c, jnp.asarray(train_data),
                     jnp.asarray(val_windows(val_data, c.seq_len, c.val_sequences)))
  t0 = time.perf_counter()
  options = {'xla_backend_optimization_level': 0} if c.quick_compile else None
  run = jax.jit(jax.vmap(train)).lower(params, rest, lrs, keys).compile(compiler_options=options)
  out = jax.tree.map(np.asarray, run(params, rest, lrs, keys))
  seconds = time.perf_counter() - t0
  out = {k: np.asarray(v, np.float64).reshape((r, s) + v.shape[1:]) for k, v in out.items()}
  curve = out['train_curve']
  tail = max(1, min(c.log_every, c.num_steps))
  out['train_init'] = curve[..., 0]
  with np.errstate(invalid='ignore'):
    out['train_final'] = np.mean(curve[..., -tail:], axis=-1)
  out['nonfinite'] = np.any(~np.isfinite(curve), axis=-1)
  out['diverged'] = robustness.diverged(out['train_final'], out['train_init'], out['nonfinite'],
                                        c.diverge_factor)
  out['attn_logit_init'] = out['attn_logit'][..., 0]
  out['attn_logit_max'] = _nanmax(out['attn_logit'])
  out['log_z_final'] = out['log_z'][..., -1]
  out['log_z_max_abs'] = _nanmax(np.abs(out['log_z']))
  out['params'] = count_params(states[0][0])
  out['seconds'] = seconds
  out['tokens_per_second'] = r * s * c.num_steps * c.batch_size * c.seq_len / seconds
  return out


def _nanmax(x: np.ndarray) -> np.ndarray:
  """Max over the last axis ignoring NaN (NaN where every entry is); inf stays inf."""
  seen = np.any(~np.isnan(x), axis=-1)
  out = np.full(x.shape[:-1], np.nan)
  out[seen] = np.nanmax(x[seen], axis=-1)
  return out


# ---------------------------------------------------------------------------
# Statistics and claims.


def cell_summary(method: str, width: int, j: int, lr: float, r, log_every: int
                 ) -> dict[str, Any]:
  """The results.json record of rate `j` of a `train_cells` result `r` (means over seeds)."""
  val, val_se = report.mean_se(r['val'][j], single=math.nan)
  logit, logit_se = report.mean_se(r['attn_logit_max'][j], single=math.nan)
  thin = lambda a: [float(v) for v in np.mean(a[j], axis=0)[::log_every]]
  return dict(method=method, width=width, lr=lr, val_loss=val, val_loss_se=val_se,
              val_loss_init=float(np.mean(r['val_init'][j])),
              train_loss=float(np.mean(r['train_final'][j])),
              train_loss_init=float(np.mean(r['train_init'][j])),
              attn_logit_init=float(np.mean(r['attn_logit_init'][j])),
              attn_logit_max=logit, attn_logit_max_se=logit_se,
              log_z_final=float(np.mean(r['log_z_final'][j])),
              log_z_max_abs=float(np.mean(r['log_z_max_abs'][j])),
              diverged=bool(np.any(r['diverged'][j])),
              diverged_seeds=int(np.sum(r['diverged'][j])),
              train_curve=thin(r['train_curve']), attn_logit_curve=thin(r['attn_logit']),
              log_z_curve=thin(r['log_z']))


def analyze(cells: Sequence[Mapping[str, Any]], tolerance: float) -> dict[str, Any]:
  """Statistics of one (method, width)'s cells (`cell_summary` records, one per rate):
  `best_lr`, `best_loss` (+ `best_loss_se`), `good_lrs` (loss within `tolerance` of the best),
  `lr_sensitivity` (`robustness.sensitivity` of the mean final validation loss, a diverged cell
  counting as its initial loss), `diverged_cells`, `cells`."""
  loss = np.array([math.nan if x['diverged'] else x['val_loss'] for x in cells])
  out: dict[str, Any] = dict(best_lr=math.nan, best_loss=math.nan, best_loss_se=math.nan,
                             good_lrs=[])
  if np.any(np.isfinite(loss)):
    b = int(np.nanargmin(loss))
    out.update(best_lr=cells[b]['lr'], best_loss=cells[b]['val_loss'],
               best_loss_se=cells[b]['val_loss_se'],
               good_lrs=[x['lr'] for x, v in zip(cells, loss) if v <= (1 + tolerance) * loss[b]])
  out['lr_sensitivity'] = robustness.sensitivity(loss, [x['val_loss_init'] for x in cells])
  out['diverged_cells'] = sum(x['diverged'] for x in cells)
  out['cells'] = len(cells)
  return out


def _seeds(n: int) -> str:
  return f'{n} seed' + ('s' if n != 1 else ' (no s.e.)')


def _fmt(v) -> str:
  return f'{v:.4g}'


def check_claims(analysis: Mapping[str, Mapping[int, Mapping[str, Any]]],
                 cells: Sequence[Mapping[str, Any]], rates) -> dict[str, str]:
  """The anchor first (qk-layernorm lowers SP's LR sensitivity at every width), then GmP's
  (and WN's, GmP+IMN's) sensitivity and best loss against SP's, and GmP's attention logits
  where SP's grow (`GROWTH` x their value at step 0). `analysis`: method -> width -> `analyze`;
  a claim whose methods did not run is left out."""
  out = {}
  sens = lambda m: {w: a['lr_sensitivity'] for w, a in analysis[m].items()}
  if 'sp' in analysis and 'sp_qk' in analysis:
    sp, qk = sens('sp'), sens('sp_qk')
    out['The anchor (Wortsman et al. 2023): qk-layernorm lowers SP\'s LR sensitivity at every '
        'width'] = report.claim(
            all(qk[w] < sp[w] for w in sp),
            '; '.join(f'width {w}: SP {_fmt(sp[w])}, SP+qk-norm {_fmt(qk[w])}' for w in sp),
            *sp.values(), *qk.values())
  if 'sp' not in analysis:
    return out
  sp = sens('sp')
  for m in ('gmp', 'wn', 'gmp_imn'):
    if m not in analysis:
      continue
    mine = sens(m)
    out[f"{label(m)}'s LR sensitivity is lower than SP's at every width"] = report.claim(
        all(mine[w] < sp[w] for w in sp),
        '; '.join(f'width {w}: {label(m)} {_fmt(mine[w])}, SP {_fmt(sp[w])}' for w in sp),
        *sp.values(), *mine.values())
    best = {w: analysis[m][w]['best_loss'] for w in sp}
    sp_best = {w: analysis['sp'][w]['best_loss'] for w in sp}
    out[f"{label(m)}'s best loss is within 2% of SP's at every width"] = report.claim(
        all(best[w] <= 1.02 * sp_best[w] for w in sp),
        '; '.join(f'width {w}: {label(m)} {best[w]:.4f}, SP {sp_best[w]:.4f} bits/byte '
                  f'({100 * (best[w] / sp_best[w] - 1):+.1f}%)' for w in sp),
        *best.values(), *sp_best.values())
  if 'gmp' in analysis:
    at = {(x['method'], x['width'], x['lr']): x for x in cells}
    grows = lambda x: x['attn_logit_max'] > GROWTH * x['attn_logit_init']
    spots = [(w, lr) for w in sp for lr in rates if grows(at[('sp', w, lr)])]
    name = ("GmP keeps the attention logits bounded where SP's grow (max over training above "
            f'{GROWTH:g}x step 0)')
    if not spots:
      out[name] = ("not tested: SP's attention logits grew nowhere on this grid (max over "
                   'training ' + ', '.join(
                       f'width {w}: up to {max(at[("sp", w, lr)]["attn_logit_max"] for lr in rates):.3g}'
                       for w in sp) + ')')
    else:
      detail = '; '.join(
          f'width {w} lr {lr:g}: SP {at[("sp", w, lr)]["attn_logit_max"]:.3g}, GmP '
          f'{at[("gmp", w, lr)]["attn_logit_max"]:.3g} (GmP at step 0 '
          f'{at[("gmp", w, lr)]["attn_logit_init"]:.3g})' for w, lr in spots)
      held = all(not grows(at[('gmp', w, lr)]) for w, lr in spots)
      out[name] = report.claim(held, detail, *[at[('gmp', w, lr)]['attn_logit_max']
                                               for w, lr in spots])
  return out


# ---------------------------------------------------------------------------
# Tables and figures.


def make_table(analysis, timings, rates) -> str:
  """results.md: per (method, width) the statistics; the wall time per fit."""
  rows = []
  for m, by_width in analysis.items():
    for w, a in by_width.items():
      good = (f'{min(a["good_lrs"]):g}-{max(a["good_lrs"]):g} ({len(a["good_lrs"])} of '
              f'{len(rates)})' if a['good_lrs'] else '-')
      rows.append([label(m), w, f'{a["best_lr"]:g}',
                   report.format_pair(a['best_loss'], a['best_loss_se'], 4), good,
                   f'{a["lr_sensitivity"]:.4f}', f'{a["diverged_cells"]} / {a["cells"]}'])
  table = report.markdown_table(['method', 'width', 'best lr', 'val bits/byte at best lr',
                                 'rates within 10%', 'LR sensitivity', 'diverged cells'], rows)
  times = report.markdown_table(
      ['method', 'width', 'params', 'members', 'seconds', 'tokens/s'],
      [[label(t['method']), t['width'], t['params'], t['members'], f'{t["seconds"]:.1f}',
        f'{t["tokens_per_second"]:.3g}'] for t in timings])
  return (table + '\n\nWall time per (method, width), one compiled call each (compile '
          'included):\n\n' + times)


def _side_legend(axes, ylabel: str, init_label: str, diverged_label: str) -> None:
  """The first panel's y label, and the legend right of the last panel with the dotted at-init
  line and the divergence mark added."""
  axes[0][0].set_ylabel(ylabel)
  ax = axes[0][-1]
  ax.plot([], [], ':', color='0.5', lw=1.2, label=init_label)
  ax.plot([], [], 'kx', ms=8, mew=2, label=diverged_label)
  ax.legend(fontsize=8, loc='center left', bbox_to_anchor=(1.01, 0.5))


def plot(cells, analysis, methods, widths, rates, n, workdir) -> list[str]:
  """lr_sweep.png, lr_sensitivity.png and attention_logits.png (see the module docstring)."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  at = {(x['method'], x['width'], x['lr']): x for x in cells}
  color = {m: f'C{k}' for k, m in enumerate(methods)}
  figures = []

  fig, axes = plt.subplots(1, len(widths), figsize=(4.6 * len(widths) + 1.8, 4), squeeze=False)
  for ax, w in zip(axes[0], widths):
    values = [at[(m, w, lr)]['val_loss'] for m in methods for lr in rates]
    init = np.mean([at[(m, w, lr)]['val_loss_init'] for m in methods for lr in rates])
    finite = [v for v in values if np.isfinite(v)]
    top = max(finite + [init]) * 1.05 if finite else init * 1.05
    for m in methods:
      robustness._plot_curve(ax, rates, [at[(m, w, lr)] for lr in rates], 'val_loss', color[m],
                             label(m), top)  # pylint: disable=protected-access
    ax.axhline(init, color='0.5', ls=':', lw=1.2)
    ax.set_xscale('log')
    ax.set_ylim(top=top)
    ax.set_xlabel('AdamW learning rate (peak)')
    ax.set_title(f'width {w}', fontsize=10)
  _side_legend(axes, 'final validation loss (bits per byte)', 'at init (mean)',
               'diverged (off-scale: top edge)')
  figures.append(plotting.save(
      fig, workdir, 'lr_sweep.png',
      title=f'Validation loss against the learning rate (mean +- s.e. over {_seeds(n)})'))

  fig, ax = plt.subplots(figsize=(6.5, 4))
  for m in methods:
    ax.plot(widths, [analysis[m][w]['lr_sensitivity'] for w in widths], '-o', color=color[m],
            label=label(m))
  ax.set_xscale('log')
  ax.set_xticks(widths)
  ax.set_xticklabels([str(w) for w in widths])
  ax.minorticks_off()
  ax.set_xlabel('width (d_model)')
  ax.set_ylabel('LR sensitivity (bits per byte)')
  ax.legend(fontsize=8, loc='center left', bbox_to_anchor=(1.01, 0.5))
  figures.append(plotting.save(
      fig, workdir, 'lr_sensitivity.png',
      title=f'LR sensitivity (Wortsman et al.) of the validation loss, {_seeds(n)} per cell',
      fontsize=9))

  fig, axes = plt.subplots(1, len(widths), figsize=(4.6 * len(widths) + 1.8, 4), squeeze=False)
  for ax, w in zip(axes[0], widths):
    for m in methods:
      row = [at[(m, w, lr)] for lr in rates]
      ax.plot(rates, [x['attn_logit_max'] for x in row], '-o', ms=3, color=color[m], label=label(m))
      bad = [x['diverged'] for x in row]
      if any(bad):
        ax.plot(np.asarray(rates)[bad], np.asarray([x['attn_logit_max'] for x in row])[bad], 'x',
                ms=8, mew=2, color=color[m])
    inits = [at[(m, w, lr)]['attn_logit_init'] for m in methods for lr in rates]
    ax.axhline(np.mean(inits), color='0.5', ls=':', lw=1.2)
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xlabel('AdamW learning rate (peak)')
    ax.set_title(f'width {w}', fontsize=10)
  _side_legend(axes, 'max attention logit over training', 'at step 0 (mean)', 'diverged')
  figures.append(plotting.save(
      fig, workdir, 'attention_logits.png',
      title=f'Max |q.k|/sqrt(d_head) over training against the rate (mean over {_seeds(n)})'))
  return figures


# ---------------------------------------------------------------------------
# The study.


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs the study of `config` and writes its files. Returns `{'summary': what results.json
  holds, 'cells': every cell's record, 'runs': (method, width) -> train_cells' arrays}`."""
  validate.check_config(config, CONFIG_RULES)
  c = config
  t_start = time.perf_counter()
  path, flag = corpus_path(c)
  data = load_corpus(path, c.seq_len, flag)
  train_data, val_data = split_corpus(data)
  methods = list(validate.split_names(c.methods))
  widths = sorted(c.widths)
  rates = sorted(float(r) for r in c.learning_rates)
  os.makedirs(workdir, exist_ok=True)
  print(f'[language_model] {path}: {len(train_data)} train / {len(val_data)} validation bytes; '
        f'depth {c.depth}, head_dim {c.head_dim}, widths {widths}, {len(rates)} rates x '
        f'{c.num_seeds} seeds, {c.num_steps} steps of {c.batch_size} x {c.seq_len} bytes; '
        f'methods on the {c.where} projections', flush=True)
  cells, runs, rows, timings = [], {}, [], []
  analysis: dict[str, dict[int, Any]] = {}
  for m in methods:
    analysis[m] = {}
    for w in widths:
      r = train_cells(m, w, rates, c, train_data, val_data)
      runs[(m, w)] = r
      mine = [cell_summary(m, w, j, lr, r, c.log_every) for j, lr in enumerate(rates)]
      cells += mine
      a = analysis[m][w] = analyze(mine, c.good_tolerance)
      rows += [dict(method=m, width=w, lr=lr, seed_index=i, val_loss=r['val'][j, i],
                    val_loss_init=r['val_init'][j, i], train_loss=r['train_final'][j, i],
                    train_loss_init=r['train_init'][j, i],
                    attn_logit_init=r['attn_logit_init'][j, i],
                    attn_logit_max=r['attn_logit_max'][j, i], log_z_final=r['log_z_final'][j, i],
                    log_z_max_abs=r['log_z_max_abs'][j, i], diverged=bool(r['diverged'][j, i]))
               for j, lr in enumerate(rates) for i in range(c.num_seeds)]
      timings.append(dict(method=m, width=w, params=r['params'],
                          members=len(rates) * c.num_seeds, seconds=r['seconds'],
                          tokens_per_second=r['tokens_per_second']))
      print(f'[language_model] {m} width {w} ({r["params"]} params): {len(rates)} rates x '
            f'{c.num_seeds} seeds in one call, {a["diverged_cells"]} diverged, best '
            f'{a["best_loss"]:.4f} bits/byte at lr {a["best_lr"]:g}, LR sensitivity '
            f'{a["lr_sensitivity"]:.4f}; {r["seconds"]:.1f} s incl. compile '
            f'({r["tokens_per_second"]:.3g} tokens/s)', flush=True)
  claims = check_claims(analysis, cells, rates)
  figures = plot(cells, analysis, methods, widths, rates, c.num_seeds, workdir) if c.plots else []
  summary = dict(
      cells=cells, analysis=analysis, timings=timings, learning_rates=rates, widths=widths,
      corpus=path, train_bytes=len(train_data), val_bytes=len(val_data),
      divergence_rule=f'a non-finite training loss at some step, or a final training loss (mean '
      f'of the last {c.log_every} steps) not finite or above {c.diverge_factor:g} x step 0\'s',
      anchor=dict(paper='Wortsman et al. 2023, arXiv 2309.14322',
                  issue_check='d 64, 2 layers, 4 heads, seq 64, batch 32, 300 steps, 7 rates '
                  '1e-3..1, 1 seed: LR sensitivity 0.244 without qk-layernorm, 0.163 with; max '
                  'attention logit 5.7 -> 3.9e5 without, below ~4 with'))
  table = make_table(analysis, timings, rates)
  summary = report.write(workdir, 'language_model', summary=summary, rows=rows, table=table,
                         claims=claims, config=c, started=t_start, figures=figures)
  return {'summary': summary, 'cells': cells, 'runs': runs}
