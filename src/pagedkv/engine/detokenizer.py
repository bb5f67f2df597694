"""``Detokenizer``: the one owner of a sample's text (UTF-8 completion, stop strings, hold-back).

Each new token is decoded together with a short window of the tokens before it, never the whole
output, so a token costs the same at position 10 and at position 10,000. The window starts at a
character boundary (the last point where the decoded text did not end in an incomplete
character) and keeps one chunk of context before the new tokens, because some decoders render a
token differently at the start of a text (a SentencePiece word marker loses its space there).

Released text never includes what could still change or be cut:

* an incomplete UTF-8 character (the decoder shows it as a trailing U+FFFD), and
* the longest suffix that is a proper prefix of some stop string: a stop string may start
  there, and released text is never taken back.

Stop strings are searched only in text not yet released, which is enough: a match that started
in released text would have been held back (its first characters were a stop prefix). When one
push completes several stop strings, the match that starts earliest wins.

This module needs no torch: the tokenizer is duck-typed (``decode(ids, skip_special_tokens=)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.model.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"  # what a decoder shows for bytes that do not (yet) form a character


class Detokenizer:
    """Incremental text of one sample. Mutates only itself; one instance per sample.

    ``text`` is the concatenation of every delta returned by ``push`` and ``flush``; it equals
    ``tokenizer.decode(ids)`` of the pushed ids, without trailing U+FFFD (an incomplete or
    undecodable end is never released), cut before the first stop string met, and minus what
    is still held back while the sample runs.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: tuple[str, ...] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("a stop string must not be empty")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = tuple(stop)
        # Every proper prefix of every stop string: what a held-back suffix may be.
        self._stop_prefixes = frozenset(s[:k] for s in stop for k in range(1, len(s)))
        self._max_hold_chars = max((len(s) - 1 for s in stop), default=0)
        # The window: the ids since the last character boundary but one. Its first _read ids
        # are the context (they decoded to a clean end); the rest are new since then.
        self._window_ids: list[int] = []
        self._read = 0
        self._seen_chars = 0  # characters of the window's text already taken
        self._pending = ""  # taken but held back: it may be the start of a stop string
        self._done = False
        self._released: list[str] = []  # the deltas; joined only when ``text`` is read
        self.stopped = False
        self.num_tokens = 0

    @property
    def text(self) -> str:
        """All text released so far. Joining costs O(text) once after new deltas, so a caller
        that needs only what is new should use the deltas instead."""
        if len(self._released) != 1:
            self._released = ["".join(self._released)]
        return self._released[0]

    def push(self, token_id: int) -> str:
        """Feed one new token; return the text it releases ("" while held back or stopped)."""
        self.num_tokens += 1
        if self._done:
            return ""
        self._window_ids.append(token_id)
        window = self._decode(self._window_ids)
        clean = not window.endswith(_INCOMPLETE)
        complete = window if clean else window.rstrip(_INCOMPLETE)
        new = complete[self._seen_chars :]
        self._seen_chars = max(self._seen_chars, len(complete))
        if clean:
            # Slide the window: the tokens decoded before this push become the only context,
            # and older ids are dropped (memory stays as flat as time).
            del self._window_ids[: self._read]
            self._read = len(self._window_ids)
            self._seen_chars = len(self._decode(self._window_ids))
        return self._take(new) if new else ""

    def flush(self) -> str:
        """The sample ended for another reason (EOS, length, abort): release what was held
        back for a stop string that can no longer come. Later calls return ""."""
        if self._done:
            return ""
        self._done = True
        delta, self._pending = self._pending, ""
        self._released.append(delta)
        return delta

    def _take(self, new: str) -> str:
        candidate = self._pending + new
        hits = [at for at in (candidate.find(s) for s in self._stops) if at != -1]
        if hits:
            release, self._pending = candidate[: min(hits)], ""
            self.stopped = self._done = True
        else:
            hold = self._hold_chars(candidate)
            release = candidate[: len(candidate) - hold]
            self._pending = candidate[len(candidate) - hold :]
        self._released.append(release)
        return release

    def _hold_chars(self, candidate: str) -> int:
        """Length of the longest suffix of ``candidate`` that a stop string starts with."""
        for k in range(min(len(candidate), self._max_hold_chars), 0, -1):
            if candidate[-k:] in self._stop_prefixes:
                return k
        return 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
