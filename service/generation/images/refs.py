"""An image named by a request, before it is fetched, and the limits and errors of images."""

from __future__ import annotations

from dataclasses import dataclass

from service.generation.errors import ValidationError


@dataclass(frozen=True)
class ImageRef:
    """One image of a request: a `data:` / `http(s)` URL or raw bytes (gRPC), and the request
    field that named it (every error names it: `messages[0].content[1].image_url`)."""

    field: str
    url: str = ""
    data: bytes = b""


@dataclass(frozen=True)
class ImageLimits:
    """The router's image flags (--max-images-per-request, --max-image-pixels, ...)."""

    max_images: int = 8
    max_pixels: int = 4096 * 4096
    # Encoded size, data URLs and fetched bodies alike; 10 MiB keeps a base64 data URL (4/3 of
    # it) under the public API's 16 MiB message limit (service/api/server.py).
    max_bytes: int = 10 * 1024 * 1024
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    # Fetching from private, loopback, link-local or reserved addresses (off: an image URL must
    # not become a way into the operator's network) ...
    allow_private: bool = False
    # ... or only from these networks (CIDRs, e.g. an internal image store's "10.1.2.0/24").
    allowed_networks: tuple[str, ...] = ()


class ImageError(ValidationError):
    """An image is refused (400): undecodable, unsupported format, too many pixels, fetch
    failure. The message names the content part."""


class ImageTooLargeError(ImageError):
    """An image's encoded bytes exceed --max-image-bytes (413)."""
