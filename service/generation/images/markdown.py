"""TGI's images in `inputs`: markdown `![alt](url)`, each replaced by the model's image token."""

from __future__ import annotations

import re

from service.generation.images.refs import ImageRef

# `![alt](url)`: the URL runs to the closing parenthesis (data URLs hold no spaces or parens).
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def markdown_images(text: str, image_token: str) -> tuple[str, tuple[ImageRef, ...]]:
    """The text with each markdown image replaced by `image_token`, and the images in order
    (each named `inputs.images[i]` in errors)."""
    refs: list[ImageRef] = []

    def take(match: re.Match[str]) -> str:
        refs.append(ImageRef(f"inputs.images[{len(refs)}]", url=match.group(1)))
        return image_token

    return _IMAGE.sub(take, text), tuple(refs)
