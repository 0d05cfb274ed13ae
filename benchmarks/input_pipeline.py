r"""Host cost per image of the ImageNet input pipeline, on generated JPEGs (no data needed).

  python -m benchmarks.input_pipeline [--images=256] [--batch=32] [--repeats=5] \
      [--workers=1,2] [--size=500x375] [--source=bytes|arrays] [--out=FILE.json] [--tiny]

`--images` JPEGs of `--size` (ImageNet's typical 500x375; smooth random shapes plus noise, so
they compress like photographs, ~60-100 KB each) are generated in memory with PIL. Timed:

- `train`: `experiments.vision.augmentation`'s train transform of `config.augment='imagenet'`
  (decode, random-resized crop at 224, flip; with `--source=arrays` the decode happens in the
  source, as for the CIFAR archive's in-memory arrays, and is still inside the timing);
- `eval`: the eval transform (decode, shorter side to 256, centre crop 224).

Also timed: a full decode alone (the floor of the host work per image). Per transform: ms and
images/s per image on one core (the transform called on batches in this
thread; min and median over `--repeats` passes over all images, in wall time and in this
thread's CPU time, which other jobs on a shared machine inflate less), and images/s through
`experiments.vision.loader.Loader` with each count of grain worker processes in `--workers`
(one thread each; 0: one thread of this process; median over the repeats) and the speed-up of
the largest count over the smallest. Colour jitter and lighting are not host work once they
run in the train step on the device (see docs/speed.md). `--tiny` shrinks everything (the test
suite runs that).
"""

from __future__ import annotations

import io
import json
import os
import platform
import statistics
import time

from absl import app
from absl import flags
import ml_collections
import numpy as np

from experiments.vision import augmentation
from experiments.vision import loader as loader_lib

FLAGS = flags.FLAGS
SOURCES = ('bytes', 'arrays')


def define_flags():
  """Defines the command's flags (only when run as a script, so imports never clash)."""
  flags.DEFINE_integer('images', 256, 'Number of generated JPEGs.')
  flags.DEFINE_integer('batch', 32, 'Batch size of the loader and of the one-core passes.')
  flags.DEFINE_integer('repeats', 5, 'Timed passes over all images per measurement.')
  flags.DEFINE_list('workers', ['1', '2'], 'Loader worker-process counts to time (0: in-process).')
  flags.DEFINE_string('size', '500x375', 'Generated image size, WIDTHxHEIGHT.')
  flags.DEFINE_enum('source', None, SOURCES,
                    'What the source returns: encoded JPEG bytes (decoded by the transform) or '
                    'decoded arrays (decoded by the source). Default: bytes where the pipeline '
                    'accepts them.')
  flags.DEFINE_bool('tiny', False, 'Few tiny images (smoke test of the benchmark itself).')
  flags.DEFINE_string('out', None, 'Write the results as JSON to this file.')


def make_jpegs(n: int, width: int, height: int, seed: int = 0, quality: int = 90) -> list[bytes]:
  """`n` JPEG-encoded RGB images of `width` x `height`: smooth colour fields plus noise."""
  from PIL import Image  # pylint: disable=g-import-not-at-top

  if n < 1 or width < 1 or height < 1:
    raise ValueError(f'need n >= 1 images of a positive size, got n={n}, {width}x{height}.')
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), np.int16)
    img = np.clip(img + rng.integers(-12, 13, img.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format='JPEG', quality=quality)
    out.append(buf.getvalue())
  return out


class JpegSource:
  """Random access to in-memory JPEGs: `get` returns the bytes, or decoded arrays."""

  def __init__(self, jpegs: list[bytes], decode: bool):
    self.jpegs, self.decode = jpegs, decode
    self.labels = np.zeros(len(jpegs), np.int32)

  def __len__(self):
    return len(self.jpegs)

  def get(self, indices):
    from PIL import Image  # pylint: disable=g-import-not-at-top

    items = [self.jpegs[int(i)] for i in indices]
    if self.decode:
      items = [np.asarray(Image.open(io.BytesIO(b)).convert('RGB')) for b in items]
    return items, self.labels[indices]


def _accepts_bytes() -> bool:
  return bool(getattr(augmentation, 'DECODES_BYTES', False))


def run(images: int = 256, batch: int = 32, repeats: int = 5, workers=(1, 2),
        size: tuple[int, int] = (500, 375), source: str | None = None, crop: int = 224,
        resize_range: tuple[int, int] = (256, 480), eval_resize: int = 256,
        out: str | None = None, tiny: bool = False) -> dict:
  """Times the train and eval transforms; returns (and optionally writes) the results."""
  if tiny:  # no worker processes unless asked (each start costs seconds)
    images, batch, repeats, size = 8, 4, 1, (40, 30)
    workers = workers if workers != (1, 2) else (0, 1)
    crop, resize_range, eval_resize = 16, (18, 32), 18
  source = source or ('bytes' if _accepts_bytes() else 'arrays')
  if source not in SOURCES:
    raise ValueError(f'source must be one of {SOURCES}, got {source!r}.')
  if source == 'bytes' and not _accepts_bytes():
    raise ValueError('this input pipeline does not decode bytes; use --source=arrays.')
  workers = [int(w) for w in workers]
  if batch < 1 or images < batch or repeats < 1 or not workers or min(workers) < 0:
    raise ValueError(f'need 1 <= batch <= images, repeats >= 1 and workers >= 0; got '
                     f'batch={batch}, images={images}, repeats={repeats}, workers={workers}.')
  from PIL import Image  # pylint: disable=g-import-not-at-top

  jpegs = make_jpegs(images, *size)
  src = JpegSource(jpegs, decode=source == 'arrays')
  config = ml_collections.ConfigDict(dict(augment='imagenet', image_size=crop,
                                          resize_range=resize_range, eval_resize=eval_resize))
  decode_times = []
  for r in range(repeats + 1):  # the floor: a full decode of every image, one core
    t = time.perf_counter()
    for b in jpegs:
      np.asarray(Image.open(io.BytesIO(b)).convert('RGB'))
    if r:
      decode_times.append(time.perf_counter() - t)
  rows = []
  for name, train in (('train', True), ('eval', False)):
    augment = augmentation.make_augment(config, train)
    u = np.random.default_rng(1).random((images, augmentation.NUM_UNIFORMS), dtype=np.float32)
    starts = range(0, images - batch + 1, batch)
    n = len(starts) * batch

    def one_pass():
      t, c = time.perf_counter(), time.thread_time()
      for s in starts:
        idx = np.arange(s, s + batch)
        augment(src.get(idx)[0], u[idx])
      return time.perf_counter() - t, time.thread_time() - c

    one_pass()  # warm-up (imports, allocator)
    passes = [one_pass() for _ in range(repeats)]
    times, cpu = [p[0] for p in passes], [p[1] for p in passes]
    row = {'transform': name, 'images': n, 'ms_per_image_min': 1e3 * min(times) / n,
           'ms_per_image_median': 1e3 * statistics.median(times) / n,
           'cpu_ms_per_image_min': 1e3 * min(cpu) / n,
           'cpu_ms_per_image_median': 1e3 * statistics.median(cpu) / n,
           'images_per_s_one_core': n / statistics.median(times)}
    for w in workers:
      # w grain worker processes of one thread each (0: one thread of this process), one
      # iterator over all passes, as the trainer uses it; the first pass starts the workers.
      loader = loader_lib.Loader(src, batch, train=train, augment=augment, seed=0,
                                 num_workers=w, num_threads=1, prefetch=2)
      batches = loader.iterate(0)
      rates = []
      for r in range(repeats + 1):
        t = time.perf_counter()
        count = sum(len(next(batches)['label']) for _ in range(loader.steps_per_epoch))
        if r:
          rates.append(count / (time.perf_counter() - t))
      del batches  # stops the workers
      row[f'images_per_s_{w}_workers'] = statistics.median(rates)
    if len(workers) > 1:
      row['speedup'] = row[f'images_per_s_{max(workers)}_workers'] / row[
          f'images_per_s_{min(workers)}_workers']
    rows.append(row)
  result = {'benchmark': 'input_pipeline', 'tiny': tiny, 'source': source, 'size': list(size),
            'crop': crop, 'batch': batch, 'repeats': repeats, 'workers': workers,
            'cpu_count': os.cpu_count(), 'load_average': list(os.getloadavg()),
            'machine': platform.processor() or platform.machine(),
            'decode_ms_per_image_min': 1e3 * min(decode_times) / images,
            'decode_ms_per_image_median': 1e3 * statistics.median(decode_times) / images,
            'rows': rows}
  if out:
    with open(out, 'w') as f:
      json.dump(result, f, indent=2)
  return result


def main(argv):
  del argv
  width, height = (int(v) for v in FLAGS.size.lower().split('x'))
  result = run(images=FLAGS.images, batch=FLAGS.batch, repeats=FLAGS.repeats,
               workers=FLAGS.workers, size=(width, height), source=FLAGS.source, out=FLAGS.out,
               tiny=FLAGS.tiny)
  print(f'source={result["source"]} size={result["size"]} load average '
        f'{result["load_average"]}; full decode alone {result["decode_ms_per_image_min"]:.2f}-'
        f'{result["decode_ms_per_image_median"]:.2f} ms/image')
  for row in result['rows']:
    ws = ' '.join(f'{w} workers {row[f"images_per_s_{w}_workers"]:.0f} img/s'
                  for w in result['workers'])
    print(f'{row["transform"]:5s}: one core {row["ms_per_image_min"]:.2f}-'
          f'{row["ms_per_image_median"]:.2f} ms/image (min-median; thread CPU time '
          f'{row["cpu_ms_per_image_min"]:.2f}-{row["cpu_ms_per_image_median"]:.2f}), '
          f'{row["images_per_s_one_core"]:.0f} img/s; {ws}'
          + (f'; speed-up {row["speedup"]:.2f}x' if 'speedup' in row else ''))


if __name__ == '__main__':
  define_flags()
  app.run(main)
