"""Image URLs fetched over http(s): only from allowed hosts, only to public addresses, bounded in time and size."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections.abc import Callable

import certifi
import httpx

from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.vision.limits import ImageLimits

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class MediaFetcher:
    """Fetches an image URL's bytes under the server's `ImageLimits`.

    The host must be allowed (`--allowed-media-domains`); its name is resolved here and every address it resolves to
    checked (loopback, link-local, private, reserved and multicast ranges are refused unless `allow_private`), then the
    connection goes to the checked address, so a second lookup cannot point it elsewhere. Redirects are followed by
    hand, each new URL checked the same way. The body is read as a stream and cut at `max_bytes`; the whole fetch,
    redirects included, has `fetch_timeout` seconds. No proxy from the environment is used: it would connect for us.
    """

    def __init__(
        self,
        limits: ImageLimits,
        public: Callable[[IPAddress], bool] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.limits = limits
        self._public = public or is_public  # which addresses count as public (tests stand in their own)
        # Built once: loading the CA bundle takes a while, which a request must not spend on the event loop.
        self._tls = tls or ssl.create_default_context(cafile=certifi.where())

    async def fetch(self, url: str, param: str) -> bytes:
        """The URL's body; any refusal or failure is a 400 naming `param`."""
        limits = self.limits
        parsed = _parse(url, param)
        if not limits.allowed_domains:
            raise BadRequestError(
                "this server fetches no image URLs: send the image inline as a data: URL (base64), or start the "
                "server with --allowed-media-domains",
                param=param,
            )
        try:
            return await asyncio.wait_for(self._follow(parsed, param), limits.fetch_timeout)
        except asyncio.TimeoutError as exc:
            raise BadRequestError(
                f"fetching the image timed out after {limits.fetch_timeout:g} s", param=param
            ) from exc

    async def _follow(self, url: httpx.URL, param: str) -> bytes:
        async with httpx.AsyncClient(
            verify=self._tls, trust_env=False, follow_redirects=False, timeout=self.limits.fetch_timeout
        ) as client:
            for _ in range(self.limits.max_redirects + 1):
                address = await self._checked_address(url, param)
                request = client.build_request(
                    "GET",
                    url.copy_with(host=str(address)),
                    headers={"Host": url.netloc.decode("ascii"), "Accept": "image/*", "Accept-Encoding": "identity"},
                    extensions={"sni_hostname": url.host},
                )
                try:
                    response = await client.send(request, stream=True)
                    try:
                        location = response.headers.get("location")
                        if response.status_code in _REDIRECTS and location:
                            url = _parse(str(url.join(location)), param)
                            continue
                        if response.status_code >= 400:
                            raise BadRequestError(
                                f"fetching the image failed: the server answered HTTP {response.status_code}",
                                param=param,
                            )
                        return await self._body(response, param)
                    finally:
                        await response.aclose()
                except httpx.HTTPError as exc:
                    raise BadRequestError(
                        f"fetching the image failed: {exc or type(exc).__name__}", param=param
                    ) from exc
        raise BadRequestError(f"fetching the image took more than {self.limits.max_redirects} redirects", param=param)

    async def _checked_address(self, url: httpx.URL, param: str) -> IPAddress:
        """The address to connect to: every address the host resolves to must be allowed, and the first is taken."""
        if not self.limits.allows_host(url.host):
            raise BadRequestError(
                f"image URLs from '{url.host}' are not allowed (--allowed-media-domains)", param=param
            )
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            found = await asyncio.get_running_loop().getaddrinfo(url.host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise BadRequestError(
                f"fetching the image failed: '{url.host}' could not be resolved", param=param
            ) from exc
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in found]
        if not addresses:
            raise BadRequestError(f"fetching the image failed: '{url.host}' has no address", param=param)
        if not self.limits.allow_private:
            for address in addresses:
                if not self._public(address):
                    raise BadRequestError(
                        f"image URLs to '{url.host}' are not allowed: it resolves to a loopback, private or reserved "
                        "address (--allow-private-media-urls)",
                        param=param,
                    )
        return addresses[0]

    async def _body(self, response: httpx.Response, param: str) -> bytes:
        limit = self.limits.max_bytes
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit, param)
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > limit:
                raise _too_large(limit, param)
        return bytes(body)


def is_public(address: IPAddress) -> bool:
    """Whether an address is on the public internet (an IPv4-mapped IPv6 address is judged as its IPv4 one)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


def _parse(url: str, param: str) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise BadRequestError(f"the image URL is not valid: {exc}", param=param) from exc
    if parsed.scheme not in ("http", "https"):
        raise BadRequestError(
            f"image URLs of scheme '{parsed.scheme}' are not supported: use a data: URL or http(s)", param=param
        )
    if not parsed.host:
        raise BadRequestError("the image URL has no host", param=param)
    return parsed


def _too_large(limit: int, param: str) -> BadRequestError:
    return BadRequestError(f"the image is larger than the {limit} bytes allowed (--max-image-bytes)", param=param)
