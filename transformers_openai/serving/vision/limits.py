"""What a request's images may be: how many, how large, and where the server may fetch them from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageLimits:
    """The image bounds of one server (`model_loader.image_limits` reads them from the settings).

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

    def allows_host(self, host: str) -> bool:
        return "*" in self.allowed_domains or host.lower().rstrip(".") in self.allowed_domains
