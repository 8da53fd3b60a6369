"""Unit tests of shard.engine.stopping."""

from __future__ import annotations

from shard.engine.stopping import StoppingCriteria, StopReason

EOS = 2


def feed(criteria: StoppingCriteria, pieces: list[tuple[int, str]]) -> list[StopReason | None]:
    """Checks tokens one by one (token id, its text); returns each step's result."""
    text, results = "", []
    for count, (tok, piece) in enumerate(pieces, start=1):
        text += piece
        results.append(criteria.check(tok, text, count))
    return results


def test_values_are_public_finish_reasons():
    assert [r.value for r in StopReason] == ["length", "eos_token", "stop_sequence"]


def test_eos_token():
    c = StoppingCriteria({EOS, 7}, max_new_tokens=10, stop_sequences=[])
    assert feed(c, [(5, "a"), (6, "b"), (7, "</s>")]) == [None, None, StopReason.EOS_TOKEN]


def test_ignore_eos_token_runs_to_length():
    c = StoppingCriteria({EOS}, max_new_tokens=3, stop_sequences=[], ignore_eos_token=True)
    assert feed(c, [(EOS, ""), (EOS, ""), (EOS, "")]) == [None, None, StopReason.LENGTH]


def test_length():
    c = StoppingCriteria({EOS}, max_new_tokens=2, stop_sequences=["zzz"])
    assert feed(c, [(5, "a"), (6, "b")]) == [None, StopReason.LENGTH]
    # Counts include tokens generated before a preemption: the first check may already be over.
    assert StoppingCriteria({EOS}, 4, []).check(5, "abcd", 4) is StopReason.LENGTH


def test_stop_sequence_at_end():
    c = StoppingCriteria({EOS}, max_new_tokens=10, stop_sequences=["\n\n", "END"])
    assert feed(c, [(5, "Hello"), (6, " END")]) == [None, StopReason.STOP_SEQUENCE]
    assert c.matched_stop == "END"


def test_stop_sequence_spanning_tokens():
    c = StoppingCriteria({EOS}, max_new_tokens=20, stop_sequences=["STOP"])
    pieces = [(1, "He"), (12, "llo"), (13, " S"), (14, "T"), (15, "O"), (16, "P"), (17, "!")]
    assert feed(c, pieces)[:6] == [None] * 5 + [StopReason.STOP_SEQUENCE]


def test_stop_sequence_inside_last_token_text():
    # A token whose text contains the stop sequence followed by more characters.
    c = StoppingCriteria({EOS}, max_new_tokens=20, stop_sequences=["\n"])
    assert feed(c, [(5, "line"), (6, ".\nThe")]) == [None, StopReason.STOP_SEQUENCE]


def test_stop_sequence_found_when_text_lags():
    # The detokenizer holds text back while a UTF-8 character is incomplete: the text can stay
    # the same for a few tokens and then grow by several characters at once.
    c = StoppingCriteria({EOS}, max_new_tokens=20, stop_sequences=["日本"])
    assert feed(c, [(5, "x"), (6, ""), (7, ""), (8, "日"), (9, ""), (10, "本")]) == [None] * 5 + [
        StopReason.STOP_SEQUENCE
    ]


def test_stop_sequence_overlapping_previous_text():
    c = StoppingCriteria({EOS}, max_new_tokens=100, stop_sequences=["abc"])
    assert c.check(5, "xxab", 1) is None
    assert c.check(6, "xxabc", 2) is StopReason.STOP_SEQUENCE


def test_empty_stop_sequences_are_ignored():
    c = StoppingCriteria({EOS}, max_new_tokens=5, stop_sequences=[""])
    assert feed(c, [(5, "a")]) == [None]


def test_priority_eos_then_stop_then_length():
    # All three on the same token: EOS wins.
    c = StoppingCriteria({EOS}, max_new_tokens=2, stop_sequences=["b"])
    assert feed(c, [(5, "a"), (EOS, "b")]) == [None, StopReason.EOS_TOKEN]
    # Stop sequence and length: the stop sequence wins.
    c = StoppingCriteria({EOS}, max_new_tokens=2, stop_sequences=["b"])
    assert feed(c, [(5, "a"), (6, "b")]) == [None, StopReason.STOP_SEQUENCE]
    # EOS and length: EOS wins.
    c = StoppingCriteria({EOS}, max_new_tokens=1, stop_sequences=[])
    assert feed(c, [(EOS, "")]) == [StopReason.EOS_TOKEN]
