"""benchmarks/input_pipeline.py runs on tiny images and writes its JSON (no timing assertions)."""

import io
import json

import numpy as np
from PIL import Image
import pytest

from benchmarks import input_pipeline as bench


def test_tiny_run_writes_json_with_every_row(tmp_path):
  out = tmp_path / 'ip.json'
  result = bench.run(tiny=True, out=str(out))
  saved = json.loads(out.read_text())
  assert saved == json.loads(json.dumps(result))
  assert 0 < saved['decode_ms_per_image_min'] <= saved['decode_ms_per_image_median']
  assert saved['tiny'] is True and [r['transform'] for r in saved['rows']] == ['train', 'eval']
  for row in saved['rows']:
    for key in ('ms_per_image_min', 'ms_per_image_median', 'cpu_ms_per_image_min',
                'images_per_s_0_workers', 'images_per_s_1_workers', 'speedup'):
      assert row[key] > 0, (row['transform'], key)
    assert row['ms_per_image_min'] <= row['ms_per_image_median']
    assert row['cpu_ms_per_image_min'] <= row['cpu_ms_per_image_median']


def test_both_sources_run_and_generated_jpegs_decode():
  for source in bench.SOURCES:
    assert bench.run(tiny=True, source=source, workers=(0,))['source'] == source
  jpegs = bench.make_jpegs(2, 50, 30)
  with Image.open(io.BytesIO(jpegs[0])) as im:
    assert im.format == 'JPEG' and im.size == (50, 30)
  src = bench.JpegSource(jpegs, decode=True)
  images, labels = src.get(np.array([1, 0]))
  assert images[0].shape == (30, 50, 3) and labels.dtype == np.int32


def test_bad_settings_fail_clearly():
  with pytest.raises(ValueError, match='source must be one of'):
    bench.run(tiny=True, source='files')
  with pytest.raises(ValueError, match='batch <= images'):
    bench.run(images=2, batch=4)
  with pytest.raises(ValueError, match='positive size'):
    bench.make_jpegs(1, 0, 10)
