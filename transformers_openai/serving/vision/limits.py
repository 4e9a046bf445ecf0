"""What a request's images may be: how many, how large, and where the server may fetch them from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers_openai.settings import Settings


@dataclass(frozen=True)
class ImageLimits:
    """The image bounds of one server (from its settings; tests build their own).

    `allowed_domains`: hosts whose http(s) URLs may be fetched, compared without case; `*` allows any host. None by
    default: images come inline as `data:` URLs. `allow_private`: those hosts may resolve to loopback, link-local,
    private or reserved addresses (a trusted network's own image server).
    """

    max_images: int = 8
    max_pixels: int = 16_000_000
    max_bytes: int = 10 * 1024 * 1024
    allowed_domains: frozenset[str] = frozenset()
    allow_private: bool = False
    fetch_timeout: float = 10.0
    max_redirects: int = 3

    @classmethod
    def from_settings(cls, settings: Settings) -> ImageLimits:
        return cls(
            max_images=settings.limit_mm_per_prompt,
            max_pixels=settings.max_image_pixels,
            max_bytes=settings.max_image_bytes,
            allowed_domains=frozenset(
                d.strip().lower().rstrip(".") for d in settings.allowed_media_domains if d.strip()
            ),
            allow_private=settings.allow_private_media_urls,
            fetch_timeout=settings.media_fetch_timeout,
        )

    def allows_host(self, host: str) -> bool:
        return "*" in self.allowed_domains or host.lower().rstrip(".") in self.allowed_domains
