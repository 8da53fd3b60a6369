"""Unit tests of shard.text.detokenizer over real `tokenizers` tokenizers (byte-level BPE and
SentencePiece-style Metaspace)."""

from __future__ import annotations

import random

import pytest

from shard.text.detokenizer import IncrementalDetokenizer
from shard.tools.tiny_model import CORPUS, build_tokenizer

TEXTS = [
    "café 日本 🚀",
    "The quick brown fox jumps over the lazy dog.",
    "naïve façade über straße — 中文文本 emoji 🔥✨🎉 done",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "数字 2024 and symbols: ∑∫√ ≠ ≤ — “quotes” ‘single’",
    "🎉🎉🎉 mixed 🇫🇷 flags and 👩‍💻 ZWJ sequences",
]


@pytest.fixture(scope="module")
def byte_level():
    return build_tokenizer(512)


@pytest.fixture(scope="module")
def metaspace():
    """A SentencePiece-style tokenizer: '▁' marks a leading space, and the decoder drops the
    leading space of the first token of every decode call."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS * 4 + TEXTS, trainer=trainer)
    return tok


def stream(
    tokenizer, prompt_ids: list[int], gen_ids: list[int]
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detok.push(t) for t in gen_ids], detok


def random_text(rng: random.Random) -> str:
    alphabet = (
        list("abcdefg hijk XYZ 0123,.!?\n")
        + list("éèüßç日本語中文テキスト")
        + ["🚀", "🔥", "✨", "🎉", "👍"]
    )
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))


def check_stream(tokenizer, text: str, split: float) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    cut = int(len(ids) * split)
    # A prompt tokenized from valid text ends on a character boundary: move the cut back to one.
    while cut > 0 and tokenizer.decode(ids[:cut]).endswith("\ufffd"):
        cut -= 1
    prompt, gen = ids[:cut], ids[cut:]
    pushes, detok = stream(tokenizer, prompt, gen)
    expected = tokenizer.decode(gen, skip_special_tokens=False)
    # With a prompt, the first generated token may keep a leading space the standalone decode
    # strips (SentencePiece); the byte-level decoder never strips.
    if prompt:
        whole = tokenizer.decode(prompt + gen, skip_special_tokens=False)
        expected = whole[len(tokenizer.decode(prompt, skip_special_tokens=False)) :]
    assert "".join(pushes) == expected
    assert detok.text == expected
    assert not any("\ufffd" in p for p in pushes)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("split", [0.0, 0.3, 0.7])
def test_byte_level_stream_equals_decode(byte_level, text: str, split: float):
    check_stream(byte_level, text, split)


def test_byte_level_without_prompt_equals_decode_of_generated(byte_level):
    for text in TEXTS:
        ids = byte_level.encode(text, add_special_tokens=False).ids
        pushes, _ = stream(byte_level, [], ids)
        assert "".join(pushes) == byte_level.decode(ids) == text


def test_random_texts(byte_level, metaspace):
    rng = random.Random(0)
    for _ in range(150):
        text = random_text(rng)
        check_stream(byte_level, text, rng.random())
        check_stream(metaspace, text, rng.random())


@pytest.mark.parametrize("text", TEXTS)
def test_metaspace_keeps_leading_space_of_first_generated_token(metaspace, text: str):
    enc = metaspace.encode("hello world " + text, add_special_tokens=False)
    cut = enc.tokens.index("\u2581w")  # generation starts with the '▁w' token
    pushes, _ = stream(metaspace, enc.ids[:cut], enc.ids[cut:])
    assert pushes[0] == " w"
    # Decoded alone, the same token would lose its space.
    assert metaspace.decode(enc.ids[cut : cut + 1]) == "w"
    check_stream(metaspace, "hello world " + text, 0.2)


def test_emoji_split_across_byte_tokens(byte_level):
    prompt = byte_level.encode("Party:", add_special_tokens=True).ids  # with BOS
    gen = byte_level.encode(" 🎉!", add_special_tokens=False).ids
    pieces = [byte_level.id_to_token(t) for t in gen]
    assert len(gen) >= 4, pieces  # the emoji's 4 bytes span several tokens
    pushes, detok = stream(byte_level, prompt, gen)
    # Nothing (not even a replacement character) until the emoji's last byte arrives.
    emoji_done = next(i for i, p in enumerate(pushes) if "🎉" in p)
    assert all("\ufffd" not in p for p in pushes)
    assert "".join(pushes[: emoji_done + 1]) == " 🎉"
    assert pushes[emoji_done - 1] == ""
    assert detok.text == " 🎉!"


def test_special_tokens_return_their_content(byte_level):
    eos = byte_level.token_to_id("</s>")
    bos = byte_level.token_to_id("<s>")
    ids = byte_level.encode("café", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(byte_level, [bos])
    assert "".join(detok.push(t) for t in ids) == "café"
    assert detok.push(eos) == "</s>"
    assert detok.is_special(eos) and detok.is_special(bos)
    assert not any(detok.is_special(t) for t in ids)


def test_invalid_utf8_is_not_held_forever_and_flush(byte_level):
    lead = byte_level.encode("🎉", add_special_tokens=False).ids[0]  # a lone lead-byte token
    a = byte_level.token_to_id("a")
    detok = IncrementalDetokenizer(byte_level, [])
    assert detok.push(lead) == ""
    # Genuinely invalid text is emitted (with U+FFFD) once more characters follow.
    assert detok.push(a) == "\ufffda"
    # A dangling incomplete character at the end is held back until flush().
    assert detok.push(lead) == ""
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""
    assert detok.text == "\ufffda\ufffd"
    # A run of invalid bytes that never completes is emitted after a bounded hold.
    detok = IncrementalDetokenizer(byte_level, [])
    pushes = [detok.push(lead) for _ in range(6)]
    assert "".join(pushes) != "" and all(p == "" for p in pushes[:3])
