"""Decode, resize, centre-crop and normalise images for efficientnet_lite0.

Input ``input_image_bytes``: BYTES ``[batch, 1]``, each element an encoded image
(JPEG, PNG, or anything Pillow reads). Output ``image_tensor``: FP32
``[batch, 3, 224, 224]`` (RGB, CHW), computed by ``preprocessing.py`` — the same
module the example build uses for the golden outputs (copied next to this file by
``examples/build_pipelines.py``): EXIF orientation, shorter side to 256 (bilinear),
centre crop 224, ``(pixel - 127) / 128``.

A request whose image is empty, not decodable, truncated or larger than the
``max_pixels`` parameter gets a 400 (``TritonError.INVALID_ARG``) naming the
element; the other requests of the same ``execute`` call are unaffected.
"""

import io
import json
import warnings

import numpy as np
import preprocessing
import triton_python_backend_utils as pb_utils
from PIL import Image, UnidentifiedImageError

DEFAULT_MAX_PIXELS = 40_000_000


class BadImage(ValueError):
    """An input element that is not an acceptable image."""


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = config.get("parameters", {})
        self.max_pixels = int(
            params.get("max_pixels", {}).get("string_value", "") or DEFAULT_MAX_PIXELS
        )
        # Pillow's own decompression-bomb guard stays above ours.
        Image.MAX_IMAGE_PIXELS = max(self.max_pixels, Image.MAX_IMAGE_PIXELS or 0)

    def _decode(self, data: bytes, where: str) -> np.ndarray:
        if not data:
            raise BadImage(f"{where} is empty: expected the bytes of a JPEG or PNG image")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))
                width, height = image.size
                if width * height > self.max_pixels:
                    raise BadImage(
                        f"{where} is {width}x{height} = {width * height / 1e6:.1f} megapixels, "
                        f"over this model's limit of {self.max_pixels / 1e6:.1f} megapixels "
                        "(parameter max_pixels)"
                    )
                return preprocessing.preprocess_image(image)
        except BadImage:
            raise
        except UnidentifiedImageError:
            raise BadImage(
                f"{where} is not an image Pillow can decode ({len(data)} bytes starting "
                f"{data[:8]!r}); send the raw bytes of a JPEG or PNG file"
            ) from None
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise BadImage(f"{where} could not be decoded: {e}") from None

    def execute(self, requests):
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "input_image_bytes").as_numpy()
            try:
                batch = np.stack(
                    [
                        self._decode(item, f"input_image_bytes[{i}]")
                        for i, item in enumerate(images.reshape(-1))
                    ]
                )
            except BadImage as e:
                error = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("image_tensor", batch)])
            )
        return responses
