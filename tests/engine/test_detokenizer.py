"""The Detokenizer against an independent reference: the full decode of every prefix.

The reference needs no incremental state: after token k the visible text is
``decode(ids[:k])`` without a trailing U+FFFD (an incomplete character); the first k whose
visible text holds a stop string ends the sample, cut where the earliest match starts; while
running, exactly the longest suffix that is a proper prefix of a stop string is held back.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.engine.detokenizer import Detokenizer
from pagedkv.model.embedded import embedded_model_path
from pagedkv.model.gguf import gguf_metadata, read_gguf
from pagedkv.model.tokenizer import tokenizer_from_gguf_metadata

REPLACEMENT = "\ufffd"


class ByteTokenizer:
    """Stand-in: token id = one byte, decoded as UTF-8 with U+FFFD for bad or cut bytes."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


class VocabTokenizer:
    """Stand-in: token id = index into a list of strings."""

    def __init__(self, vocab):
        self.vocab = vocab

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[i] for i in ids)


@pytest.fixture(scope="module")
def smollm():
    """The embedded model's tokenizer alone (read from the GGUF header, no weights)."""
    return tokenizer_from_gguf_metadata(gguf_metadata(read_gguf(embedded_model_path())))


def visible(tokenizer, ids, skip):
    text = tokenizer.decode(ids, skip_special_tokens=skip)
    return text.rstrip(REPLACEMENT) if text.endswith(REPLACEMENT) else text


def held_chars(text, stops):
    """Brute force: the earliest position from which ``text`` could still become a stop."""
    for p in range(len(text)):
        if any(s.startswith(text[p:]) and len(text) - p < len(s) for s in stops):
            return len(text) - p
    return 0


def check_stream(tokenizer, ids, stops, skip=True):
    """Push ``ids`` one by one, comparing every step with the reference; then flush."""
    detok = Detokenizer(tokenizer, tuple(stops), skip_special_tokens=skip)
    streamed = ""
    for k in range(1, len(ids) + 1):
        before = detok.text
        delta = detok.push(ids[k - 1])
        streamed += delta
        assert detok.text == streamed and detok.text.startswith(before)  # never retracts
        assert detok.num_tokens == k
        assert REPLACEMENT not in delta or REPLACEMENT in visible(tokenizer, ids[:k], skip)
        seen = visible(tokenizer, ids[:k], skip)
        hits = [at for at in (seen.find(s) for s in stops) if at != -1]
        if hits:
            assert detok.stopped and detok.text == seen[: min(hits)]
            assert all(detok.push(i) == "" for i in ids[k:])
            assert detok.flush() == "" and detok.text == seen[: min(hits)]
            return detok
        assert not detok.stopped
        assert detok.text == seen[: len(seen) - held_chars(seen, stops)]
    tail = detok.flush()
    assert detok.text == streamed + tail == visible(tokenizer, ids, skip)
    assert detok.flush() == "" and detok.push(ids[0] if ids else 0) == ""
    return detok


# --- a 4-character stop string after 20 characters ----------------------------------------


@pytest.mark.parametrize(
    ("text", "exposed"),
    [
        ("abcdefghijklmnopqrst", 20),  # no suffix can start "WXYZ": nothing to hold
        ("abcdefghijklmnopqrsW", 19),
        ("abcdefghijklmnopqrWX", 18),
        ("abcdefghijklmnopqWXY", 17),
    ],
)
def test_a_stop_string_holds_back_only_what_could_start_it(text, exposed):
    """The old engine always held 3 characters (17 exposed), the old server 3 more (14)."""
    detok = Detokenizer(ByteTokenizer(), ("WXYZ",))
    streamed = "".join(detok.push(b) for b in text.encode())
    assert streamed == detok.text == text[:exposed]
    assert detok.flush() == text[exposed:] and detok.text == text and not detok.stopped


def test_a_held_back_prefix_that_does_not_complete_is_released_later():
    detok = Detokenizer(ByteTokenizer(), ("WXYZ",))
    assert [detok.push(b) for b in b"aWXq"] == ["a", "", "", "WXq"]


# --- stop strings -------------------------------------------------------------------------


def test_the_earliest_starting_stop_wins_when_one_push_completes_several():
    detok = Detokenizer(VocabTokenizer([" world", " wo", "rld"]), ("r", "orl", "d"))
    assert detok.push(0) == " w" and detok.stopped  # "orl" starts before "r" and "d"
    assert detok.push(1) == "" and detok.text == " w" and detok.num_tokens == 2


def test_token_by_token_the_first_completed_stop_ends_the_text():
    detok = Detokenizer(ByteTokenizer(), ("r", "orl", "d"))
    streamed = "".join(detok.push(b) for b in b" world and more")
    assert detok.stopped and streamed == detok.text == " wo"


def test_a_stop_string_split_across_tokens(smollm):
    ids = smollm.encode("The answer is 42.<|end|> And more text.", add_special_tokens=False)
    detok = check_stream(smollm, ids, ("<|end|>",))
    assert detok.stopped and detok.text == "The answer is 42."


def test_overlapping_stop_strings_on_the_real_tokenizer(smollm):
    ids = smollm.encode("one banana, two bananas", add_special_tokens=False)
    detok = check_stream(smollm, ids, ("nanas", "ana,", "two"))
    assert detok.stopped and detok.text == "one ban"


# --- UTF-8 --------------------------------------------------------------------------------


def test_a_character_split_across_tokens_is_released_whole(smollm):
    ids = smollm.encode("日本語のテキスト 🙂", add_special_tokens=False)
    detok = Detokenizer(smollm)
    deltas = [detok.push(i) for i in ids]
    assert "" in deltas  # some token ends inside a character ...
    assert all(REPLACEMENT not in d for d in deltas)  # ... and it is never shown half
    assert "".join(deltas) + detok.flush() == "日本語のテキスト 🙂"


def test_an_incomplete_character_at_the_end_is_never_released():
    detok = Detokenizer(ByteTokenizer())
    assert [detok.push(b) for b in "aé".encode()[:2]] == ["a", ""]
    assert detok.flush() == "" and detok.text == "a"


def test_complete_text_before_a_cut_character_in_one_token_is_released():
    detok = Detokenizer(VocabTokenizer(["b\ufffd", "b日"]))
    assert detok.push(0) == "b"


def test_an_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="stop string"):
        Detokenizer(ByteTokenizer(), ("",))


# --- properties ---------------------------------------------------------------------------

STOP_ALPHABET = "abé日🙂 "
stops_strategy = st.lists(st.text(STOP_ALPHABET, min_size=1, max_size=4), max_size=3)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(STOP_ALPHABET, max_size=40),
    noise=st.lists(st.integers(0, 255), max_size=6),
    stops=stops_strategy,
)
def test_byte_streams_match_the_reference(text, noise, stops):
    """Multi-byte characters cut at every byte, and bytes that are not UTF-8 at all."""
    check_stream(ByteTokenizer(), list(text.encode()) + noise, stops)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(STOP_ALPHABET + "xyzé語\n", max_size=40),
    random_ids=st.lists(st.integers(0, 49151), max_size=12),
    stops=stops_strategy,
    skip=st.booleans(),
)
def test_real_token_streams_match_the_reference(smollm, text, random_ids, stops, skip):
    """The embedded tokenizer: its own encodings, and random ids (special tokens, byte pieces
    that split characters, bytes that never form one)."""
    check_stream(smollm, smollm.encode(text, add_special_tokens=False), stops, skip)
    check_stream(smollm, random_ids, stops, skip)


# --- cost ---------------------------------------------------------------------------------


def test_each_push_decodes_a_short_window_not_the_whole_output(smollm):
    sizes = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            sizes.append(len(ids))
            return smollm.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "A long answer with 日本語 and 🙂 in it. " * 80
    ids = smollm.encode(text, add_special_tokens=False)
    detok = Detokenizer(Counting(), ("<never>",))
    for i in ids:
        detok.push(i)
    detok.flush()
    assert detok.text == text
    assert len(ids) > 1000 and max(sizes) <= 8 and len(sizes) <= 2 * len(ids)
