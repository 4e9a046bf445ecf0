"""Image parts' bytes to RGB pictures: formats, the byte and pixel bounds before decoding, and the digest."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.vision.images import data_url_bytes, decode_image, image_digest
from transformers_openai.serving.vision.limits import ImageLimits

PARAM = "messages.0.content.1"
LIMITS = ImageLimits()


def encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def refused(fn: object, *args: object) -> BadRequestError:
    with pytest.raises(BadRequestError) as caught:
        fn(*args)  # type: ignore[operator]
    assert caught.value.param == PARAM
    return caught.value


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_decodes_to_rgb_of_its_size(fmt: str) -> None:
    picture = Image.new("RGB", (37, 21), (200, 30, 40))
    image = decode_image(data_url_bytes(data_url(encoded(picture, fmt)), LIMITS, PARAM), LIMITS, PARAM)
    assert image.mode == "RGB" and image.size == (37, 21)
    red, green, blue = image.getpixel((10, 10))  # type: ignore[misc]
    assert red > 150 and green < 80 and blue < 80  # lossy formats and GIF's palette are close, not exact


def test_animated_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert Image.open(io.BytesIO(data)).n_frames == 2  # type: ignore[attr-defined]
    assert decode_image(data, LIMITS, PARAM).getpixel((4, 4)) == (255, 0, 0)


def test_transparent_pixels_become_white() -> None:
    picture = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    picture.putpixel((0, 0), (10, 20, 30, 255))
    image = decode_image(encoded(picture, "PNG"), LIMITS, PARAM)
    assert image.getpixel((3, 3)) == (255, 255, 255)
    assert image.getpixel((0, 0)) == (10, 20, 30)


@pytest.mark.parametrize(
    ("picture", "fmt", "pixel"),
    [
        (Image.fromarray(np.full((4, 4), 40000, dtype=np.uint16)), "PNG", (156, 156, 156)),  # 16-bit: scaled
        (Image.new("CMYK", (4, 4), (0, 255, 255, 0)), "JPEG", (255, 0, 0)),
        (Image.new("LA", (4, 4), (100, 255)), "PNG", (100, 100, 100)),
        (Image.new("1", (4, 4), 1), "PNG", (255, 255, 255)),
        (Image.new("L", (4, 4), 7), "PNG", (7, 7, 7)),
    ],
    ids=["png-16-bit", "jpeg-cmyk", "png-grey-alpha", "png-1-bit", "png-grey"],
)
def test_other_modes_become_rgb(picture: Image.Image, fmt: str, pixel: tuple[int, int, int]) -> None:
    image = decode_image(encoded(picture, fmt), LIMITS, PARAM)
    assert image.mode == "RGB"
    found = image.getpixel((1, 1))
    assert isinstance(found, tuple) and all(abs(a - b) <= 2 for a, b in zip(found, pixel, strict=True)), found


def test_animated_webp_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))]
    data = encoded(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    assert decode_image(data, LIMITS, PARAM).getpixel((4, 4)) == (255, 0, 0)


def test_data_url_of_other_media_type_or_without_base64_is_refused() -> None:
    png = encoded(Image.new("RGB", (2, 2)), "PNG")
    assert "not an image" in refused(data_url_bytes, data_url(png, "text/html"), LIMITS, PARAM).message
    plain = "data:image/png," + base64.b64encode(png).decode()
    assert "base64" in refused(data_url_bytes, plain, LIMITS, PARAM).message
    assert "base64" in refused(data_url_bytes, "data:image/png;base64,%%%%", LIMITS, PARAM).message
    assert "','" in refused(data_url_bytes, "data:image/png;base64", LIMITS, PARAM).message


def test_byte_bound_is_checked_on_the_base64_before_decoding_it() -> None:
    limits = ImageLimits(max_bytes=1024)
    # Not even valid base64: refused for its size, so the payload was never decoded.
    error = refused(data_url_bytes, "data:image/png;base64," + "!" * 4000, limits, PARAM)
    assert "--max-image-bytes" in error.message
    just_fits = data_url(b"x" * 1024)
    assert len(data_url_bytes(just_fits, limits, PARAM)) == 1024
    assert "--max-image-bytes" in refused(data_url_bytes, data_url(b"x" * 1025), limits, PARAM).message
    assert "--max-image-bytes" in refused(decode_image, b"x" * 1025, limits, PARAM).message


def _png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header (IHDR, CRC fixed) claims another size: a few bytes that would decode to a huge canvas."""
    png = encoded(Image.new("RGB", (1, 1)), "PNG")
    start = png.index(b"IHDR")
    header = struct.pack(">II", width, height) + png[start + 12 : start + 17]
    chunk = b"IHDR" + header
    return png[:start] + chunk + struct.pack(">I", zlib.crc32(chunk)) + png[start + 21 :]


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_pixel_bound_is_read_from_the_header_before_decoding() -> None:
    bomb = _png_claiming(10_000, 10_000)  # under Pillow's own bound, over ours
    assert len(bomb) < 100
    error = refused(decode_image, bomb, LIMITS, PARAM)
    assert "10000x10000" in error.message and "--max-image-pixels" in error.message
    small = ImageLimits(max_pixels=100)
    assert (
        "--max-image-pixels" in refused(decode_image, encoded(Image.new("RGB", (11, 10)), "PNG"), small, PARAM).message
    )
    assert decode_image(encoded(Image.new("RGB", (10, 10)), "PNG"), small, PARAM).size == (10, 10)


def test_pillows_own_bomb_guard_reads_as_too_many_pixels() -> None:
    huge = ImageLimits(max_pixels=10**12)  # past Pillow's own bound: its error is answered as ours
    assert "--max-image-pixels" in refused(decode_image, _png_claiming(200_000, 200_000), huge, PARAM).message


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not an image at all",
        encoded(Image.new("RGB", (64, 64), (1, 2, 3)), "PNG")[:60],  # cut short
        encoded(Image.new("RGB", (8, 8)), "BMP"),  # a format images do not come in
        encoded(Image.new("RGB", (8, 8)), "TIFF"),
    ],
    ids=["empty", "text", "truncated-png", "bmp", "tiff"],
)
def test_undecodable_data_is_refused(data: bytes) -> None:
    assert "could not be" in refused(decode_image, data, LIMITS, PARAM).message


def test_digest_follows_the_pixels_not_the_file_format() -> None:
    picture = Image.effect_noise((16, 12), 50).convert("RGB")
    other = Image.effect_noise((16, 12), 51).convert("RGB")
    as_png = decode_image(encoded(picture, "PNG"), LIMITS, PARAM)
    as_webp = decode_image(encoded(picture, "WEBP", lossless=True), LIMITS, PARAM)
    assert image_digest([as_png]) == image_digest([as_webp])
    assert image_digest([as_png]) != image_digest([other])
    assert image_digest([as_png, other]) != image_digest([other, as_png])  # the order counts
    assert len(image_digest([])) == 64
