"""Images as prompt parts: the `Image` helper and the conversion of a prompt given as parts
(text and images) into the request's typed `input_chunks` / a chat message's `content_parts`.

Shared by both clients so that they accept exactly the same prompts.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from ._generated.tokenwire.v1 import ChatContentPart, ChatImageUrl, ImagePart, InputChunk


@dataclass(frozen=True)
class Image:
    """An image for a vision-language model: its encoded bytes (PNG, JPEG or WebP) or a URL the
    server reads (`data:image/...;base64,...` or http(s); the server refuses private and
    loopback addresses unless it allows them). Exactly one of `data` and `url` is set.

        Image.from_file("cat.png"), Image(data=png_bytes), Image(url="https://...")
    """

    data: bytes | None = None
    url: str | None = None

    def __post_init__(self) -> None:
        if (self.data is None) == (self.url is None):
            raise TypeError("Image needs exactly one of data (bytes) and url (str)")
        if self.data is not None and not isinstance(self.data, (bytes, bytearray, memoryview)):
            raise TypeError(f"Image.data must be bytes, not {type(self.data).__name__}")
        if self.url is not None and not isinstance(self.url, str):
            raise TypeError(f"Image.url must be a str, not {type(self.url).__name__}")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Image:
        """The image in a local file (its bytes are sent; the server never reads your files)."""
        return cls(data=Path(path).read_bytes())

    @classmethod
    def from_bytes(cls, data: bytes) -> Image:
        return cls(data=bytes(data))

    @classmethod
    def from_url(cls, url: str) -> Image:
        return cls(url=url)

    def to_part(self) -> ImagePart:
        """The generated message (tokenwire.v1.ImagePart) for this image."""
        if self.data is not None:
            return ImagePart(data=bytes(self.data))
        return ImagePart(url=self.url)

    def to_url(self) -> str:
        """The image as a URL: its own, or its bytes as a `data:` URL (chat's image_url)."""
        if self.url is not None:
            return self.url
        assert self.data is not None
        return f"data:{_media_type(bytes(self.data))};base64,{base64.b64encode(self.data).decode()}"


# One part of a prompt: text, or an image (the helper, the generated ImagePart, raw bytes or a
# pathlib.Path of an image file), or an already built InputChunk.
PromptPart: TypeAlias = "str | Image | ImagePart | InputChunk | bytes | os.PathLike[str]"
Prompt: TypeAlias = "str | Sequence[PromptPart]"


def _media_type(data: bytes) -> str:
    """The image type named by the bytes' signature; the server checks the bytes either way
    (an unsupported or undecodable image is refused there, naming the part)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "application/octet-stream"


def _image(part: object) -> Image | ImagePart | None:
    if isinstance(part, (Image, ImagePart)):
        return part
    if isinstance(part, (bytes, bytearray, memoryview)):
        return Image(data=bytes(part))
    if isinstance(part, os.PathLike):
        return Image.from_file(part)
    return None


def input_chunks(inputs: Sequence[Any]) -> list[InputChunk]:
    """The typed prompt parts of `inputs`, in order. TypeError names the first part of another
    type (a plain str path is text, never a file: wrap it in Image.from_file)."""
    if isinstance(inputs, (bytes, bytearray, memoryview)) or not isinstance(inputs, Sequence):
        raise TypeError(
            f"inputs must be a str or a sequence of str / Image / ImagePart parts, not "
            f"{type(inputs).__name__}"
        )
    chunks: list[InputChunk] = []
    for i, part in enumerate(inputs):
        if isinstance(part, str):
            chunks.append(InputChunk(text=part))
        elif isinstance(part, InputChunk):
            chunks.append(part)
        elif (image := _image(part)) is not None:
            chunks.append(
                InputChunk(image=image.to_part() if isinstance(image, Image) else image)
            )
        else:
            raise TypeError(
                f"inputs[{i}] must be a str (text) or an image (Image, ImagePart, bytes or a "
                f"pathlib.Path), not {type(part).__name__}"
            )
    if not chunks:
        raise TypeError("inputs must not be an empty sequence")
    return chunks


def _content_part(part: Any, where: str) -> ChatContentPart:
    """One OpenAI-shaped content part ({"type": "text", "text"} or {"type": "image_url",
    "image_url": {"url"}}), or an Image / ChatContentPart, as the generated message."""
    if isinstance(part, ChatContentPart):
        return part
    if isinstance(part, str):
        return ChatContentPart(text=part)
    if (image := _image(part)) is not None:
        url = image.to_url() if isinstance(image, Image) else (
            image.url if image.url is not None else Image(data=image.data).to_url()
        )
        return ChatContentPart(image_url=ChatImageUrl(url=url))
    if not isinstance(part, Mapping):
        raise TypeError(
            f"{where} must be a content part ({{'type': 'text', 'text': ...}} or "
            f"{{'type': 'image_url', 'image_url': {{'url': ...}}}}) or an Image, not "
            f"{type(part).__name__}"
        )
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise TypeError(f"{where}.text must be a str, not {type(text).__name__}")
        return ChatContentPart(text=text)
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, Mapping) else value
        if not isinstance(url, str):
            raise TypeError(f"{where}.image_url.url must be a str, not {type(url).__name__}")
        return ChatContentPart(image_url=ChatImageUrl(url=url))
    raise TypeError(f"{where}.type must be 'text' or 'image_url', not {kind!r}")


def content_parts(content: Sequence[Any], where: str) -> list[ChatContentPart]:
    """A chat message's content list as typed parts; TypeError names the part
    (`messages[0].content[1]`)."""
    return [_content_part(part, f"{where}[{j}]") for j, part in enumerate(content)]
