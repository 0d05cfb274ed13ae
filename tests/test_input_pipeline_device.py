"""ImageNet transforms: the host crop (only the window resized) and the device colour/lighting.

References are test-only copies of the code these replaced (resize the whole image, then crop;
colour jitter and lighting in numpy), the colour formulas in float64.
"""

import io

import jax
import numpy as np
from PIL import Image
import pytest

from experiments.vision import augmentation
from experiments.vision import loader
from experiments.vision import sources

_GRAY = np.array([0.299, 0.587, 0.114])


def _old_resize_shorter(img, size):
  h, w = img.shape[:2]
  scale = size / min(h, w)
  nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
  return np.asarray(Image.fromarray(img).resize((nw, nh), Image.BILINEAR))


def _old_geometry(img, u, crop, resize_range):
  """The replaced host code: resize the whole image, crop, flip (colour left out)."""
  size = int(resize_range[0] + u[0] * (resize_range[1] - resize_range[0] + 1))
  img = _old_resize_shorter(img, min(max(size, crop), resize_range[1]))
  h, w = img.shape[:2]
  y = min(int(u[1] * (h - crop + 1)), h - crop)
  x = min(int(u[2] * (w - crop + 1)), w - crop)
  img = img[y:y + crop, x:x + crop]
  return img[:, ::-1] if u[3] < 0.5 else img


def _old_center(img, crop, resize):
  img = _old_resize_shorter(img, max(resize, crop))
  h, w = img.shape[:2]
  y, x = (h - crop) // 2, (w - crop) // 2
  return img[y:y + crop, x:x + crop]


def _colour_reference(img01, u, colour=augmentation.COLOUR, lighting=augmentation.LIGHTING):
  """The replaced numpy colour jitter and lighting of one image, in float64, unrounded."""
  img = np.asarray(img01, np.float64)
  if colour:
    b, c, s = 1.0 + colour * (2.0 * np.asarray(u[:3], np.float64) - 1.0)
    img = img * b
    gray = img @ _GRAY
    img = (img - gray.mean()) * c + gray.mean()
    gray = (img @ _GRAY)[..., None]
    img = (img - gray) * s + gray
  if lighting:
    u = np.asarray(u, np.float64)
    r = np.sqrt(-2.0 * np.log(max(1.0 - u[3], 1e-7)))
    alpha = lighting * r * np.array([np.cos(2 * np.pi * u[0]), np.sin(2 * np.pi * u[0]),
                                     np.cos(2 * np.pi * u[1])])
    img = img + np.asarray(augmentation._EIGVEC, np.float64) @ (
        alpha * np.asarray(augmentation._EIGVAL, np.float64))
  return np.clip(img, 0.0, 1.0)


def _photo(rng, h, w):
  """A smooth random image (resizing noise would hide geometry errors in blur)."""
  coarse = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
  return np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC))


def _jpeg(img, quality=95):
  buf = io.BytesIO()
  Image.fromarray(img).save(buf, format='JPEG', quality=quality)
  return buf.getvalue()


@pytest.mark.parametrize('colour,lighting', [(0.4, 0.1), (0.4, 0.0), (0.0, 0.1)])
def test_device_colour_lighting_equals_float64_reference(colour, lighting):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (6, 9, 7, 3), dtype=np.uint8)
  u = rng.random((6, 4), dtype=np.float32)
  u[0, 3] = 1.0 - 1e-9  # the 1e-7 floor of the Box-Muller radius
  fn = jax.jit(lambda x, v: augmentation.colour_lighting(x, v, colour, lighting))
  got = np.asarray(fn(images, u))
  assert got.dtype == np.float32 and got.shape == images.shape
  want = np.stack([_colour_reference(images[k] / 255.0, u[k], colour, lighting)
                   for k in range(6)])
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
  # Something happens: every example moves, and some pixels saturate at the clip.
  assert np.abs(got - images / 255.0).reshape(6, -1).max(1).min() > 1e-3
  # Floats in [0, 1] are taken as they are.
  np.testing.assert_allclose(np.asarray(fn(images / 255.0, u)), got, atol=1e-6)


def test_host_crop_matches_resize_then_crop_and_flip():
  rng = np.random.default_rng(1)
  crop, rr = 24, (28, 52)
  images = [_photo(rng, 37, 50), _photo(rng, 60, 31), _photo(rng, 28, 28)]
  u = rng.random((3, augmentation.NUM_UNIFORMS), dtype=np.float32)
  u[:, 3] = [0.2, 0.7, 0.4]
  got = augmentation.augment_imagenet(images, u, crop=crop, resize_range=rr)
  assert got.shape == (3, crop, crop, 3) and got.dtype == np.uint8
  for k in range(3):
    want = _old_geometry(images[k], u[k], crop, rr)
    diff = np.abs(got[k].astype(int) - want)
    assert diff.max() <= 1 and diff.mean() < 0.2, (k, diff.max(), diff.mean())
    # The unflipped window differs (it is not a symmetric image).
    other = want[:, ::-1]
    assert np.abs(got[k].astype(int) - other).mean() > 2
  ev = augmentation.center_crop_imagenet(images, crop=crop, resize=rr[0])
  for k in range(3):
    diff = np.abs(ev[k].astype(int) - _old_center(images[k], crop, rr[0]))
    assert diff.max() <= 1 and diff.mean() < 0.2


def test_bytes_grayscale_and_draft_decoding():
  rng = np.random.default_rng(2)
  img = _photo(rng, 45, 60)
  u = rng.random((1, augmentation.NUM_UNIFORMS), dtype=np.float32)
  # No reduced decode at this scale: bytes give exactly what the decoded array gives.
  decoded = np.asarray(Image.open(io.BytesIO(_jpeg(img))).convert('RGB'))
  np.testing.assert_array_equal(augmentation.augment_imagenet([_jpeg(img)], u, 16, (40, 48)),
                                augmentation.augment_imagenet([decoded], u, 16, (40, 48)))
  # Grayscale, as (h, w), (h, w, 1) and JPEG bytes: three equal channels.
  gray = img[..., 0]
  for item in (gray, gray[..., None]):
    out = augmentation.center_crop_imagenet([item], crop=16, resize=20)
    assert out.shape == (1, 16, 16, 3)
    np.testing.assert_array_equal(out[..., 0], out[..., 2])
    np.testing.assert_array_equal(out[0, ..., 0], _old_center(gray, 16, 20))
  # A large JPEG at 1/4 scale decodes reduced (draft) and stays close to the full decode.
  big = _photo(rng, 480, 640)
  full = np.asarray(Image.open(io.BytesIO(_jpeg(big))).convert('RGB'))
  draft = augmentation.center_crop_imagenet([_jpeg(big)], crop=100, resize=110)[0]
  assert np.abs(draft.astype(int) - _old_center(full, 100, 110)).mean() < 1.5


def test_bad_images_fail_clearly():
  u = np.zeros((1, augmentation.NUM_UNIFORMS), np.float32)
  with pytest.raises(ValueError, match='cannot decode an encoded image of 9 bytes'):
    augmentation.augment_imagenet([b'not a jpg'], u, 8, (8, 10))
  with pytest.raises(ValueError, match='expected a uint8 image'):
    augmentation.center_crop_imagenet([np.zeros((10, 10, 3), np.float32)], crop=8, resize=8)
  with pytest.raises(ValueError, match='2 images but 1 rows'):
    augmentation.augment_imagenet([np.zeros((10, 10, 3), np.uint8)] * 2, u, 8, (8, 10))


def test_imagenet_loader_batches_carry_colour_uniforms_per_process():
  rng = np.random.default_rng(3)
  src = sources.ArraySource(np.stack([_photo(rng, 20, 26) for _ in range(8)]), np.arange(8) % 3)
  config = type('C', (), dict(augment='imagenet', image_size=12, resize_range=(14, 20),
                              eval_resize=14))
  aug = augmentation.make_augment(config, train=True)
  full = list(loader.Loader(src, 4, train=True, augment=aug, seed=5).epoch(1))
  assert set(full[0]) == {'image', 'label', 'mask', 'colour'}
  assert full[0]['colour'].shape == (4, 4) and full[0]['colour'].dtype == np.float32
  u = np.random.default_rng([5, 1, 0, 1]).random((4, augmentation.NUM_UNIFORMS), dtype=np.float32)
  np.testing.assert_array_equal(full[0]['colour'], u[:, 4:8])
  halves = [list(loader.Loader(src, 4, train=True, augment=aug, seed=5, process_index=i,
                               process_count=2).epoch(1)) for i in range(2)]
  for j, batch in enumerate(full):
    for key in batch:
      np.testing.assert_array_equal(np.concatenate([halves[0][j][key], halves[1][j][key]]),
                                    batch[key])
  ev = next(loader.Loader(src, 4, train=False,
                          augment=augmentation.make_augment(config, False)).epoch(0))
  assert set(ev) == {'image', 'label', 'mask'} and ev['image'].shape == (4, 12, 12, 3)
