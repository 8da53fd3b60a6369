"""The bytes of an image: a `data:` URL decoded, or an `http(s)` URL fetched by the router.

Fetching is guarded so that an image URL cannot reach into the operator's network: every
address the host resolves to (on every redirect hop, through the connector's own resolver, so
no second lookup can answer differently) must be globally routable, unless
--allow-private-image-urls is set or it lies in --allow-image-networks; IP-literal hosts are
checked the same way. Redirects are followed by hand (at most
--max-image-redirects, http(s) only), the body is read up to the byte cap, the whole fetch has
one timeout, and the response must declare an image content type.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
from typing import Any
from urllib.parse import urljoin, urlsplit

from service.generation.images.refs import ImageError, ImageLimits, ImageRef, ImageTooLargeError

# The encoded formats served (OpenAI's list for vision input, less GIF).
CONTENT_TYPES = frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp"})
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class _Refused(Exception):
    """A resolved address is not allowed (raised inside the connector, caught below)."""

    def __init__(self, host: str, address: str) -> None:
        super().__init__(f"{host} resolves to {address}")


def address_allowed(address: str, limits: ImageLimits) -> bool:
    """Whether the router may connect to an IP address: a globally routable one (not private,
    loopback, link-local, shared, reserved or multicast; an IPv4-mapped IPv6 address is judged
    as its IPv4 address), or any with --allow-private-image-urls, or one inside
    --allow-image-networks."""
    if limits.allow_private:
        return True
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in ipaddress.ip_network(n, strict=False) for n in limits.allowed_networks):
        return True
    return ip.is_global and not ip.is_multicast


async def image_bytes(ref: ImageRef, limits: ImageLimits) -> bytes:
    """The encoded bytes of `ref`; ImageError (413: ImageTooLargeError) naming ref.field."""
    if ref.data:
        return _capped(ref.data, ref, limits)
    url = ref.url.strip()
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _capped(_data_url(url, ref), ref, limits)
    if scheme in ("http", "https"):
        return await _fetch(url, ref, limits)
    raise ImageError(ref.field, f"{ref.field}: the image URL must be a data: URL (base64 PNG, "
                     f"JPEG or WebP) or an http(s) URL; got scheme {scheme or 'none'!r}")


def _capped(data: bytes, ref: ImageRef, limits: ImageLimits) -> bytes:
    if len(data) > limits.max_bytes:
        raise ImageTooLargeError(ref.field, f"{ref.field}: the image has {len(data)} bytes; at "
                                 f"most {limits.max_bytes} (--max-image-bytes)")
    return data


def _data_url(url: str, ref: ImageRef) -> bytes:
    header, sep, payload = url.partition(",")
    params = header[len("data:"):].split(";")
    media = params[0].strip().lower()
    if not sep or "base64" not in (p.strip().lower() for p in params[1:]):
        raise ImageError(ref.field, f"{ref.field}: a data URL must be "
                         "data:image/<png|jpeg|webp>;base64,<data>")
    if media not in CONTENT_TYPES:
        raise ImageError(ref.field, f"{ref.field}: unsupported image type {media!r}; "
                         "supported: image/png, image/jpeg, image/webp")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(ref.field, f"{ref.field}: the data URL's base64 payload is invalid"
                         ) from None


def _check_literal(host: str, ref: ImageRef, limits: ImageLimits) -> None:
    """IP-literal hosts never reach the resolver: judged here."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return
    if not address_allowed(host, limits):
        raise _refused(ref, host, host)


def _refused(ref: ImageRef, host: str, address: str) -> ImageError:
    return ImageError(ref.field, f"{ref.field}: the image URL's host {host} resolves to "
                      f"{address}, a private, loopback or reserved address; refused (the "
                      "router allows those only with --allow-private-image-urls or "
                      "--allow-image-networks)")


def _resolver(limits: ImageLimits) -> Any:
    import aiohttp

    class CheckedResolver(aiohttp.ThreadedResolver):
        """The connector's resolver: every address of the host is checked before any connect."""

        async def resolve(self, host: str, port: int = 0,
                          family: socket.AddressFamily = socket.AF_INET) -> list[Any]:
            infos = await super().resolve(host, port, family)
            for info in infos:
                if not address_allowed(info["host"], limits):
                    raise _Refused(host, info["host"])
            return infos

    return CheckedResolver()


async def _fetch(url: str, ref: ImageRef, limits: ImageLimits) -> bytes:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=limits.fetch_timeout_s)
    connector = aiohttp.TCPConnector(resolver=_resolver(limits), use_dns_cache=False)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                         trust_env=False) as session:
            for _ in range(limits.max_redirects + 1):
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.hostname:
                    raise ImageError(ref.field, f"{ref.field}: redirected to {url!r}; only "
                                     "http(s) URLs are fetched")
                _check_literal(parts.hostname, ref, limits)
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status in _REDIRECTS and "Location" in resp.headers:
                        url = urljoin(url, resp.headers["Location"])
                        continue
                    return await _body(resp, url, ref, limits)
            raise ImageError(ref.field, f"{ref.field}: more than {limits.max_redirects} "
                             "redirects (--max-image-redirects)")
    except _Refused as refused:
        host, _, address = str(refused).partition(" resolves to ")
        raise _refused(ref, host, address) from None
    except TimeoutError:
        raise ImageError(ref.field, f"{ref.field}: fetching the image took longer than "
                         f"{limits.fetch_timeout_s:g} s (--image-fetch-timeout)") from None
    except aiohttp.ClientError as error:
        raise ImageError(ref.field, f"{ref.field}: fetching the image failed: "
                         f"{type(error).__name__}: {error}") from None


async def _body(resp: Any, url: str, ref: ImageRef, limits: ImageLimits) -> bytes:
    if resp.status != 200:
        raise ImageError(ref.field, f"{ref.field}: fetching the image failed: HTTP {resp.status}")
    media = resp.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if media not in CONTENT_TYPES:
        raise ImageError(ref.field, f"{ref.field}: the URL answered content type {media!r}; "
                         "supported: image/png, image/jpeg, image/webp")
    declared = resp.content_length
    if declared is not None and declared > limits.max_bytes:
        raise _too_large(ref, declared, limits)
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limits.max_bytes:  # the declared length may lie, or be absent
            raise _too_large(ref, size, limits)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(ref: ImageRef, size: int, limits: ImageLimits) -> ImageTooLargeError:
    return ImageTooLargeError(ref.field, f"{ref.field}: the image has more than "
                              f"{limits.max_bytes} bytes (--max-image-bytes; got {size})")


async def gather_bytes(refs: tuple[ImageRef, ...], limits: ImageLimits) -> list[bytes]:
    """Every image's bytes, fetched concurrently; the first error raises."""
    return list(await asyncio.gather(*(image_bytes(r, limits) for r in refs)))
