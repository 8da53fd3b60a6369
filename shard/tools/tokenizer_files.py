"""A model directory's tokenizer as a `tokenizers.Tokenizer`: tokenizer.json where the snapshot
has one, else what transformers' AutoTokenizer builds from the other files (sentencepiece,
vocab + merges). Here, in the model tools, so that nothing above shard.models imports
transformers (tests/test_import_layers.py)."""

from __future__ import annotations

from pathlib import Path

import tokenizers


def load_tokenizer(model_dir: Path) -> tokenizers.Tokenizer:
    path = model_dir / "tokenizer.json"
    if path.is_file():
        return tokenizers.Tokenizer.from_file(str(path))
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(model_dir)).backend_tokenizer
