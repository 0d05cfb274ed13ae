"""Per-image transforms: `(images, per-example uniforms (b, NUM_UNIFORMS))` -> a uint8 batch.

`make_augment(config, train)` picks the transform of `config.augment`: 'none', 'flip' and
'flip_crop' (`augment_flip`) take images of one size; with `augment='imagenet'` the host only
decodes, crops (resizing just the crop) and flips (`augment_imagenet`, `center_crop_imagenet`),
and training batches also carry `'colour': float32 (b, 4)`, the per-example uniforms of the
colour jitter and PCA lighting that the train step applies on the device (`colour_lighting`).
Sources may return encoded images (bytes) instead of arrays; the transforms then decode them,
the ImageNet ones at a reduced JPEG scale where the resize allows. An encoded image that cannot
be decoded is reported (`errors`, see `_each`) rather than raised, for the loader to skip.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np

# AlexNet-style PCA lighting noise (He et al. 2016 use it), RGB eigen-decomposition.
_EIGVAL = np.array([0.2175, 0.0188, 0.0045], np.float32)
_EIGVEC = np.array([[-0.5675, 0.7192, 0.4009],
                    [-0.5808, -0.0045, -0.8140],
                    [-0.5836, -0.6948, 0.4203]], np.float32)


NUM_UNIFORMS = 8


def augment_flip(images: np.ndarray, u: np.ndarray, pad_crop: int = 0) -> np.ndarray:
  """Random horizontal flips (u[:, 0] < 0.5), optionally after a random crop of a
  `pad_crop`-pixel zero padding (u[:, 1], u[:, 2] pick the offsets)."""
  images = np.asarray(images)
  out = images.copy()
  n, h, w = images.shape[:3]
  if pad_crop:
    padded = np.pad(images, ((0, 0), (pad_crop, pad_crop), (pad_crop, pad_crop), (0, 0)))
    oy = np.minimum((u[:, 1] * (2 * pad_crop + 1)).astype(int), 2 * pad_crop)
    ox = np.minimum((u[:, 2] * (2 * pad_crop + 1)).astype(int), 2 * pad_crop)
    for k in range(n):
      out[k] = padded[k, oy[k]:oy[k] + h, ox[k]:ox[k] + w]
  flip = u[:, 0] < 0.5
  out[flip] = out[flip, :, ::-1]
  return out


# What the train transform of `augment='imagenet'` leaves to the device (`colour_lighting`):
# brightness, contrast and saturation factors in [1 - COLOUR, 1 + COLOUR] and PCA lighting noise of
# scale LIGHTING, He et al. (2016) / AlexNet.
COLOUR, LIGHTING = 0.4, 0.1
DECODES_BYTES = True  # sources may return encoded images (bytes); the transforms decode them


def _open(item):
  """A source's image (encoded bytes, or an array `(h, w[, 1 or 3])` uint8) -> a PIL image.

  Encoded images are opened, not decoded: `_resized_crop` asks for a reduced JPEG decode first.
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top

  if isinstance(item, (bytes, bytearray, memoryview)):
    try:
      im = Image.open(io.BytesIO(item))
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, ...
      raise ValueError(f'cannot decode an encoded image of {len(item)} bytes: {e}') from e
    if im.mode not in ('RGB', 'L'):
      im = im.convert('RGB')
    return im
  img = np.asarray(item)
  if img.dtype != np.uint8 or not (img.ndim == 2 or (img.ndim == 3 and img.shape[-1] in (1, 3))):
    raise ValueError(f'expected a uint8 image (h, w), (h, w, 1) or (h, w, 3); got {img.dtype} '
                     f'{img.shape}.')
  return Image.fromarray(img.reshape(img.shape[:2]) if img.ndim == 3 and img.shape[-1] == 1
                         else img)


def _resized_crop(item, short: int, crop: int, uy: float | None, ux: float | None) -> np.ndarray:
  """The `crop` x `crop` window of `item` with its shorter side resized to `short`, `(crop, crop,
  3)` uint8.

  The window's offset in the resized image is `int(u * (size - crop + 1))` per axis (the centre
  for `u=None`), exactly where a resize of the whole image followed by a crop would take it; but
  only the window is computed: its box in the source's coordinates is resized to `crop` x `crop`
  (PIL bilinear with the same per-axis scale and the same sample positions, so the result is
  the resize-then-crop one up to PIL's edge handling). Encoded JPEGs are first decoded at the
  smallest power-of-2 reduction still at least as large as the resized image (`Image.draft`).
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top

  im = _open(item)
  w, h = im.size
  scale = short / min(h, w)
  nh, nw = max(short, round(h * scale)), max(short, round(w * scale))
  y = (nh - crop) // 2 if uy is None else min(int(uy * (nh - crop + 1)), nh - crop)
  x = (nw - crop) // 2 if ux is None else min(int(ux * (nw - crop + 1)), nw - crop)
  if getattr(im, 'format', None) == 'JPEG' and nw < w and nh < h:
    im.draft(im.mode, (nw, nh))  # decodes at 1/2, 1/4 or 1/8 where that stays >= (nw, nh)
  fx, fy = im.size[0] / nw, im.size[1] / nh
  box = (x * fx, y * fy, (x + crop) * fx, (y + crop) * fy)
  out = im.resize((crop, crop), Image.BILINEAR, box=box)
  if out.mode != 'RGB':
    out = out.convert('RGB')
  return np.asarray(out)


def _each(images, transform: Callable[[int, Any], np.ndarray], shape: tuple[int, ...] | None,
          errors: list | None) -> np.ndarray:
  """`transform(k, images[k])` for every image, stacked into a uint8 `(b, *shape)` batch.

  `shape` None: that of the first image transformed (`(1, 1, 3)` if none is). With a list
  `errors`, an ENCODED image that cannot be decoded (corrupt, truncated, not an image) is left
  as zeros and `errors[k]` gets the reason (the loader skips it); otherwise, and for arrays,
  the error is raised.
  """
  out = None if shape is None else np.zeros((len(images), *shape), np.uint8)
  if errors is not None:
    errors[:] = [None] * len(images)
  for k, img in enumerate(images):
    try:
      one = transform(k, img)
    except (OSError, ValueError, SyntaxError) as e:  # PIL: UnidentifiedImageError, truncated, ...
      if errors is None or not isinstance(img, (bytes, bytearray, memoryview)):
        raise
      errors[k] = f'{type(e).__name__}: {e}'
      continue
    if out is None:
      out = np.zeros((len(images), *np.shape(one)), np.uint8)
    out[k] = one
  return np.zeros((len(images), 1, 1, 3), np.uint8) if out is None else out


def augment_imagenet(images, u: np.ndarray, crop: int = 224,
                     resize_range: tuple[int, int] = (256, 480),
                     errors: list | None = None) -> np.ndarray:
  """He et al. (2016) training augmentation, host part: shorter side resized to a random size in
  `resize_range` (`u[:, 0]`), a random `crop` x `crop` crop (`u[:, 1:3]`), a random flip
  (`u[:, 3] < 0.5`). Only the crop is resized (`_resized_crop`).

  Args:
    images: `b` images, each encoded bytes or a uint8 array `(h, w[, 1 or 3])`.
    u: `(b, NUM_UNIFORMS)` uniforms in [0, 1); columns 4-7 drive `colour_lighting`.
    errors: see `_each` (undecodable encoded images recorded instead of raised).

  Returns:
    `(b, crop, crop, 3)` uint8. The colour jitter and lighting follow on the device
    (`colour_lighting`, in the train step).
  """
  if len(images) != len(u):
    raise ValueError(f'{len(images)} images but {len(u)} rows of uniforms.')

  def one(k, img):
    size = int(resize_range[0] + u[k, 0] * (resize_range[1] - resize_range[0] + 1))
    out = _resized_crop(img, min(max(size, crop), resize_range[1]), crop, u[k, 1], u[k, 2])
    return out[:, ::-1] if u[k, 3] < 0.5 else out

  return _each(images, one, (crop, crop, 3), errors)


def center_crop_imagenet(images, crop: int = 224, resize: int = 256,
                         errors: list | None = None) -> np.ndarray:
  """Evaluation: shorter side resized to `resize`, central `crop` x `crop` (only that window is
  computed, `_resized_crop`). `images`: encoded bytes or uint8 arrays; returns `(b, crop, crop,
  3)` uint8; `errors`: see `_each`."""
  return _each(images, lambda k, img: _resized_crop(img, max(resize, crop), crop, None, None),
               (crop, crop, 3), errors)


def colour_lighting(images, u, colour: float = COLOUR, lighting: float = LIGHTING):
  """Colour jitter and PCA lighting on the device, batched (jit-able; the train step calls it).

  Per example, with `f = 1 + colour * (2 u[:, 0:3] - 1)` (brightness, contrast, saturation
  factors): `x *= f_b`; `x = (x - m) f_c + m` with `m` the mean gray level (ITU-R 601 weights) of
  the image; `x = (x - g) f_s + g` with `g` the per-pixel gray; then the AlexNet PCA lighting
  offset `V (alpha * lambda)`, `alpha = lighting * r * (cos 2 pi u0, sin 2 pi u0, cos 2 pi u1)`,
  `r = sqrt(-2 log(max(1 - u3, 1e-7)))` (a Box-Muller radius); finally clipped to [0, 1].
  These are the formulas and distributions the host applied before (it also rounded to uint8).

  Args:
    images: `(b, h, w, 3)` uint8 (0..255) or float (already in [0, 1]).
    u: `(b, 4)` uniforms in [0, 1), columns 4-7 of the batch's `NUM_UNIFORMS`.
    colour, lighting: jitter and lighting strengths (0 disables).

  Returns:
    `(b, h, w, 3)` float32 in [0, 1].
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  x = jnp.asarray(images)
  x = x.astype(jnp.float32) / 255.0 if jnp.issubdtype(x.dtype, jnp.integer) else x.astype(
      jnp.float32)
  u = jnp.asarray(u, jnp.float32)
  # Weighted sums written out: a matmul would run at reduced precision on some accelerators.
  gray = lambda t: t[..., 0] * 0.299 + t[..., 1] * 0.587 + t[..., 2] * 0.114
  if colour:
    f = 1.0 + colour * (2.0 * u[:, :3] - 1.0)
    b, c, s = (f[:, i, None, None, None] for i in range(3))
    x = x * b
    m = jnp.mean(gray(x), axis=(1, 2))[:, None, None, None]
    x = (x - m) * c + m
    g = gray(x)[..., None]
    x = (x - g) * s + g
  if lighting:
    r = jnp.sqrt(-2.0 * jnp.log(jnp.maximum(1.0 - u[:, 3], 1e-7)))
    angle = 2.0 * jnp.pi * u
    alpha = lighting * r[:, None] * jnp.stack(
        [jnp.cos(angle[:, 0]), jnp.sin(angle[:, 0]), jnp.cos(angle[:, 1])], axis=-1)
    offset = jnp.sum(jnp.asarray(_EIGVEC)[None] * (alpha * jnp.asarray(_EIGVAL))[:, None, :],
                     axis=-1)
    x = x + offset[:, None, None, :]
  return jnp.clip(x, 0.0, 1.0)


def make_augment(config, train: bool) -> Callable[..., Any]:
  """The augmentation of `config.augment` ('none', 'flip', 'flip_crop' or 'imagenet'):
  `(images, uniforms (b, NUM_UNIFORMS), errors=None) -> uint8 batch` (or a dict of it and
  further per-example arrays); `errors` as in `_each`."""
  kind = config.augment
  if kind == 'imagenet':
    if train:
      # The batch carries the colour/lighting uniforms for the train step (`colour_lighting`).
      return lambda x, u, errors=None: {
          'image': augment_imagenet(x, u, crop=config.image_size,
                                    resize_range=tuple(config.resize_range), errors=errors),
          'colour': np.ascontiguousarray(u[:, 4:8], np.float32)}
    return lambda x, u, errors=None: center_crop_imagenet(
        x, crop=config.image_size, resize=config.eval_resize, errors=errors)
  if kind not in ('none', 'flip', 'flip_crop'):
    raise ValueError(f"augment must be 'none', 'flip', 'flip_crop' or 'imagenet', got {kind!r}.")

  def as_array(x, errors):
    if isinstance(x, list) and x and isinstance(x[0], (bytes, bytearray, memoryview)):
      x = _decode_same_size(x, errors)
    x = np.stack(x) if isinstance(x, list) else np.asarray(x)
    if x.ndim == 3 or x.shape[-1] == 1:  # grayscale -> RGB
      x = np.repeat(x.reshape(x.shape[:3] + (1,)), 3, axis=-1)
    return x

  if not train or kind == 'none':
    return lambda x, u, errors=None: as_array(x, errors)
  pad = 4 if kind == 'flip_crop' else 0
  return lambda x, u, errors=None: augment_flip(as_array(x, errors), u, pad_crop=pad)


class ImageSizeError(Exception):
  """Encoded images of different sizes where the augmentation does not resize them."""


def _decode_same_size(images, errors) -> np.ndarray:
  """Encoded images decoded to RGB `(b, h, w, 3)`, all of the first decodable image's size."""
  first = []  # the size of the first image decoded

  def decode(k, img):
    out = np.asarray(_open(img).convert('RGB'))
    if not first:
      first.append(out.shape)
    elif out.shape != first[0]:
      raise ImageSizeError(f"image {k} of the batch is {out.shape[:2]}, another {first[0][:2]}: "
                           "augment 'none'/'flip'/'flip_crop' do not resize; use augment="
                           "'imagenet' (resize and crop) for images of different sizes.")
    return out

  return _each(images, decode, None, errors)
