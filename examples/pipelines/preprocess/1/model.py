"""Decode, resize, centre-crop and normalise images for efficientnet_lite0.

Input ``input_image_bytes``: BYTES ``[batch, 1]``, each element an encoded image
(JPEG, PNG, or anything Pillow reads). Output ``image_tensor``: FP32
``[batch, 3, 224, 224]`` (RGB, CHW), computed by ``preprocessing.py`` — the same
module the example build uses for the golden outputs (copied next to this file by
``examples/build_pipelines.py``): EXIF orientation, shorter side to 256 (bilinear),
centre crop 224, ``(pixel - 127) / 128``.

A request whose image is empty, not decodable, truncated, larger than the
``max_pixels`` parameter, or more elongated than the ``max_aspect_ratio``
parameter gets a 400 (``TritonError.INVALID_ARG``) naming the element; the other
requests of the same ``execute`` call are unaffected (any exception while
decoding one request's images fails that request only).

Both limits are checked from the image header, before any pixel is decoded
(``Image.open`` is lazy). ``max_aspect_ratio`` bounds the resize: the shorter side
is scaled to 256, so a W x 1 image would become (256 W) x 256 pixels — 83 bytes of
PNG at 3000 x 1 asked for 760 MB. With the default ratio of 16 the resized image
is at most 4096 x 256 (about 1 megapixel, 3 MB of RGB).
"""

import io
import json
import warnings

import numpy as np
import preprocessing
import triton_python_backend_utils as pb_utils
from PIL import Image, UnidentifiedImageError

DEFAULT_MAX_PIXELS = 40_000_000
#: Longer side / shorter side above which an image is refused (the resized image
#: would be larger than RESIZE_SHORTER**2 * ratio pixels).
DEFAULT_MAX_ASPECT_RATIO = 16.0


class BadImage(ValueError):
    """An input element that is not an acceptable image."""


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = config.get("parameters", {})
        self.max_pixels = int(
            params.get("max_pixels", {}).get("string_value", "") or DEFAULT_MAX_PIXELS
        )
        self.max_aspect_ratio = float(
            params.get("max_aspect_ratio", {}).get("string_value", "") or DEFAULT_MAX_ASPECT_RATIO
        )
        # Our own header check below replaces Pillow's decompression-bomb guard, whose
        # warning / error would otherwise come out of Image.open before it.
        Image.MAX_IMAGE_PIXELS = None

    def _check_size(self, width: int, height: int, where: str) -> None:
        """Refuse, from the header alone, an image too large or too elongated."""
        if width <= 0 or height <= 0:
            raise BadImage(f"{where} has no pixels ({width}x{height})")
        if width * height > self.max_pixels:
            raise BadImage(
                f"{where} is {width}x{height} = {width * height / 1e6:.1f} megapixels, "
                f"over this model's limit of {self.max_pixels / 1e6:.1f} megapixels "
                "(parameter max_pixels)"
            )
        ratio = max(width, height) / min(width, height)
        if ratio > self.max_aspect_ratio:
            raise BadImage(
                f"{where} is {width}x{height}: its aspect ratio {ratio:.1f}:1 is over this "
                f"model's limit of {self.max_aspect_ratio:g}:1 (parameter max_aspect_ratio; "
                "resizing its shorter side to 256 would make it too large)"
            )

    def _decode(self, data: bytes, where: str) -> np.ndarray:
        if not data:
            raise BadImage(f"{where} is empty: expected the bytes of a JPEG or PNG image")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))  # lazy: reads the header only
                width, height = image.size
                self._check_size(width, height, where)
                return preprocessing.preprocess_image(image)
        except BadImage:
            raise
        except UnidentifiedImageError:
            raise BadImage(
                f"{where} is not an image Pillow can decode ({len(data)} bytes starting "
                f"{data[:8]!r}); send the raw bytes of a JPEG or PNG file"
            ) from None
        except MemoryError:
            raise BadImage(f"{where} could not be decoded: out of memory") from None
        except Exception as e:  # any decoder failure is this element's fault only
            raise BadImage(f"{where} could not be decoded: {type(e).__name__}: {e}") from None

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tensor = pb_utils.get_input_tensor_by_name(request, "input_image_bytes")
                images = tensor.as_numpy()
                batch = np.stack(
                    [
                        self._decode(item, f"input_image_bytes[{i}]")
                        for i, item in enumerate(images.reshape(-1))
                    ]
                )
            except Exception as e:  # isolated per request: never fails the others
                message = str(e) if isinstance(e, BadImage) else f"{type(e).__name__}: {e}"
                error = pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("image_tensor", batch)])
            )
        return responses
