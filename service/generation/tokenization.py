"""The model's `tokenizers` tokenizer, run on worker threads so the event loop never tokenizes.

`tokenizers` releases the GIL while encoding, so `--validation-workers` threads tokenize in
parallel with the event loop serving streams.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol


class Encoder(Protocol):
    """What validation needs from a tokenizer."""

    async def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of `text` with the model's special tokens (BOS) added, as the model saw them
        in training."""
        ...


class Tokenizing(Protocol):
    """What Tokenize (TGI's /tokenize) needs from a tokenizer."""

    async def tokenize(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[tuple[int, str, int, int], ...]:
        """(id, text, start, stop) of each token; offsets in characters."""
        ...


class TokenizerPool:
    """A `tokenizers.Tokenizer` loaded from `tokenizer.json` with a pool of worker threads."""

    def __init__(self, tokenizer_json: Path | str, workers: int = 2) -> None:
        from tokenizers import Tokenizer

        path = Path(tokenizer_json)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"--tokenizer: no tokenizer.json at {path}")
        self._tokenizer = Tokenizer.from_file(str(path))
        # Truncation and padding are the router's business (parameters.truncate), not the file's.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._executor = ThreadPoolExecutor(
            max_workers=max(1, workers), thread_name_prefix="tokenize"
        )

    def _encode_sync(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(text, add_special_tokens=True).ids)

    async def encode(self, text: str) -> tuple[int, ...]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._encode_sync, text)

    def _tokenize_sync(
        self, text: str, add_special_tokens: bool
    ) -> tuple[tuple[int, str, int, int], ...]:
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return tuple(
            (token_id, text[start:stop], start, stop)
            for token_id, (start, stop) in zip(encoding.ids, encoding.offsets, strict=True)
        )

    async def tokenize(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[tuple[int, str, int, int], ...]:
        """(id, text, start, stop) of each token of `text`; offsets in characters (TGI's
        /tokenize)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, self._tokenize_sync, text, add_special_tokens
        )

    @property
    def tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` itself (the router's detokenization: decoding is
        synchronous and cheap per token)."""
        return self._tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (synchronous; for tests and tools)."""
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
