"""An image part's bytes turned into an RGB picture, with its bounds checked before the pixels are decoded."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.vision.limits import ImageLimits

# What an image part may hold: the formats browsers show and OpenAI takes (GIF and animated WebP: the first frame).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DATA_PREFIX = "data:"


def data_url_bytes(url: str, limits: ImageLimits, param: str) -> bytes:
    """The bytes of a base64 `data:` URL; its decoded length is checked against `max_bytes` before decoding."""
    header, comma, payload = url.partition(",")
    if not comma:
        raise BadRequestError("an image data URL needs a ',' before its data", param=param)
    media = header[len(DATA_PREFIX) :].split(";")
    if "base64" not in (p.strip().lower() for p in media[1:]):
        raise BadRequestError("an image data URL must be base64 ('data:image/png;base64,...')", param=param)
    kind = media[0].strip().lower()
    if kind and not kind.startswith("image/"):
        raise BadRequestError(f"a data URL of type '{kind}' is not an image", param=param)
    payload = payload.strip()
    decoded_len = len(payload) // 4 * 3 - payload[-2:].count("=")
    if decoded_len > limits.max_bytes:
        raise BadRequestError(
            f"the image has {decoded_len} bytes, more than the {limits.max_bytes} allowed (--max-image-bytes)",
            param=param,
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequestError("the image data URL is not valid base64", param=param) from exc


def decode_image(data: bytes, limits: ImageLimits, param: str) -> Image.Image:
    """The picture in `data` (PNG, JPEG, WebP or GIF; its first frame), as RGB. Its size is read from the header and
    checked against `max_pixels` before any pixel is decoded: a small file may claim a huge canvas."""
    if len(data) > limits.max_bytes:
        raise BadRequestError(
            f"the image has {len(data)} bytes, more than the {limits.max_bytes} allowed (--max-image-bytes)",
            param=param,
        )
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        width, height = image.size
        if width * height > limits.max_pixels:
            raise _too_many_pixels(width, height, limits, param)
        image.seek(0)
        image.load()
        return _rgb(image)
    except Image.DecompressionBombError as exc:  # Pillow's own bound, past ours when --max-image-pixels is huge
        raise BadRequestError(
            f"the image has more than the {limits.max_pixels} pixels allowed (--max-image-pixels)", param=param
        ) from exc
    except UnidentifiedImageError as exc:
        raise BadRequestError(f"the image could not be read: it is no {', '.join(FORMATS)} image", param=param) from exc
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError) as exc:  # truncated or corrupt data
        raise BadRequestError(f"the image could not be decoded: {exc}", param=param) from exc


def image_digest(images: Sequence[Image.Image]) -> str:
    """A hex sha256 over the decoded images in order (mode, size, pixels): the same picture gives the same digest
    whatever its file format, so prefix reuse can key on it."""
    digest = hashlib.sha256()
    for image in images:
        digest.update(f"{image.mode}:{image.width}x{image.height};".encode())
        digest.update(image.tobytes())
    return digest.hexdigest()


def _rgb(image: Image.Image) -> Image.Image:
    """Transparent pixels become white (as on a page), not the black a plain conversion gives; 16-bit grey is scaled
    to 8 bits, not clipped at 255 as Pillow's conversion does."""
    if image.mode == "RGB":
        return image
    if image.mode == "I" or image.mode.startswith("I;16"):
        values = np.asarray(image).astype(np.int64)
        return Image.fromarray((values >> 8).clip(0, 255).astype(np.uint8), "L").convert("RGB")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        canvas = Image.new("RGBA", image.size, (255, 255, 255, 255))
        canvas.alpha_composite(image.convert("RGBA"))
        return canvas.convert("RGB")
    return image.convert("RGB")


def _too_many_pixels(width: int, height: int, limits: ImageLimits, param: str) -> BadRequestError:
    return BadRequestError(
        f"the image is {width}x{height} ({width * height} pixels), more than the {limits.max_pixels} allowed "
        "(--max-image-pixels)",
        param=param,
    )
