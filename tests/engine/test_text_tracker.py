"""Detokenising with stop strings, on a stand-in tokenizer (one character per token id)."""

from __future__ import annotations

from pagedkv.engine.outputs import TextTracker


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def feed(text: str, stop: tuple[str, ...]) -> tuple[str, str, bool]:
    tracker = TextTracker(CharTokenizer(), stop)
    streamed = ""
    ids: list[int] = []
    for ch in text:
        ids.append(ord(ch))
        streamed += tracker.update(ids)
        if tracker.stopped:
            break
    return tracker.text, streamed, tracker.stopped


def test_the_earliest_of_stop_strings_completed_together_wins():
    tracker = TextTracker(CharTokenizer(), ("r", "orl", "d"))
    tracker.update([ord(c) for c in " world"])  # one update completes all three
    assert tracker.stopped and tracker.text == " w"  # "orl" starts before "r"
    # Token by token, "r" completes first and ends the text there.
    text, _, stopped = feed(" world and more", ("r", "orl", "d"))
    assert stopped and text == " wo"


def test_a_stop_string_split_across_tokens_is_found():
    text, _, stopped = feed("abc<|end|>xyz", ("<|end|>",))
    assert stopped and text == "abc"


def test_no_stop_string_means_the_whole_text():
    text, streamed, stopped = feed("plain text", ("zz",))
    assert not stopped and text == streamed == "plain text"
