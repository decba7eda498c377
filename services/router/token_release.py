"""Log probabilities under the streamed output check: a token's entry goes out with the text
it makes, never before it, and never showing what the check redacted.

The check releases text, not tokens: it holds back a tail that may still grow into a match
and may replace what matched. Each token is given the span of the generation's text it
makes (its own text's length, when a chunk's tokens spell the chunk's text; otherwise the
chunk's whole text goes with its last token, as when a byte-level token splits a
character), and is released once the check has released the end of its span. Where a
step's released text differs from what the model wrote (a redaction), the tokens of the
changed part become one entry: the text the client was shown for them, the sum of their
log probabilities, no alternatives, and token id -1 (no one token). A token whose first
characters were redacted before its end was released goes out the same way. The entries'
texts, in order, spell exactly what the client was shown.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import takewhile

from llmmesh.types import TokenLogprob

REDACTED_TOKEN = -1  # the id of an entry standing for what a redaction replaced


@dataclass(frozen=True)
class _Piece:
    """One token, or the tokens of a chunk whose texts do not spell the chunk's."""

    entries: tuple[TokenLogprob, ...]
    span: int  # characters of the generation's text they make


@dataclass
class GuardedTokens:
    """One generation's token entries, released as the output check releases text."""

    _pending: deque[_Piece] = field(default_factory=deque)
    _raw: str = ""  # text the model wrote that the check still holds
    # The first pending piece's characters already released: what the client was shown
    # of them (in no entry yet), and whether that differs from the piece's own text.
    _head_shown: int = 0
    _head_text: str = ""
    _head_redacted: bool = False

    def add(self, text: str, entries: tuple[TokenLogprob, ...]) -> None:
        """A chunk from the engine: its text and one entry per token."""
        self._raw += text
        if not entries:
            return
        if sum(len(e.text) for e in entries) == len(text):
            self._pending += (_Piece((e,), len(e.text)) for e in entries)
        else:
            self._pending.append(_Piece(entries, len(text)))

    def release(self, shown: str, held: int) -> tuple[TokenLogprob, ...]:
        """The entries of what the check let out now: ``shown`` (as the client sees it)
        for all but the last ``held`` characters of the text added so far."""
        cut = len(self._raw) - held
        written, self._raw = self._raw[:cut], self._raw[cut:]
        head_text, head_redacted = self._head_text, self._head_redacted
        pieces, starts = self._take(len(written))
        ends = [start + piece.span for start, piece in zip(starts, pieces, strict=True)]
        taken_end = ends[-1] if ends else 0  # where the next piece's released part begins
        entries = [piece.entries for piece in pieces]
        if written == shown:
            if head_redacted and pieces:
                entries[0] = (_merged(pieces[:1], head_text + written[: ends[0]]),)
            if pieces:
                self._keep_head("", False, written[taken_end:])
            else:
                self._keep_head(head_text, head_redacted, written)
            return _flat(entries)
        changed_from, changed_to = _changed(written, shown)
        if head_redacted and pieces:
            changed_from = min(changed_from, starts[0])
        middle = [i for i, (s, e) in enumerate(zip(starts, ends, strict=True))
                  if e > changed_from and s < changed_to]  # fmt: skip
        if not middle:  # the change lies in the next piece's released start
            self._keep_head(head_text if not pieces else "", True, shown[taken_end:])
            return _flat(entries)
        first, last = middle[0], middle[-1]
        after = len(written) - max(ends[last], changed_to)
        begin = max(starts[first], 0)
        text = (head_text if starts[first] < 0 else "") + shown[begin : len(shown) - after]
        entries[first : last + 1] = [(_merged(pieces[first : last + 1], text),)]
        if changed_to > taken_end:  # the change reached into the next piece
            self._keep_head("", True, written[changed_to:])
        else:
            self._keep_head("", False, written[taken_end:])
        return _flat(entries)

    def drop(self) -> None:
        """The stream was stopped (a deny rule): nothing held goes out."""
        self._pending.clear()
        self._raw = ""
        self._head_shown, self._head_text, self._head_redacted = 0, "", False

    def _take(self, released: int) -> tuple[list[_Piece], list[int]]:
        """The pieces whose spans end within the ``released`` characters, with their starts
        there (negative for one begun in an earlier step)."""
        start = -self._head_shown
        pieces: list[_Piece] = []
        starts: list[int] = []
        while self._pending and start + self._pending[0].span <= released:
            piece = self._pending.popleft()
            pieces.append(piece)
            starts.append(start)
            start += piece.span
        self._head_shown = released - start
        return pieces, starts

    def _keep_head(self, earlier: str, redacted: bool, now: str) -> None:
        """What the client has been shown of the next piece, ``earlier`` then ``now``, in
        no entry yet; ``redacted``: it differs from the piece's own text."""
        self._head_text = earlier + now
        self._head_redacted = redacted


def _merged(pieces: list[_Piece], text: str) -> TokenLogprob:
    logprob = sum(e.logprob for piece in pieces for e in piece.entries)
    return TokenLogprob(REDACTED_TOKEN, text, logprob, 0)


def _flat(entries: list[tuple[TokenLogprob, ...]]) -> tuple[TokenLogprob, ...]:
    return tuple(e for group in entries for e in group)


def _changed(written: str, shown: str) -> tuple[int, int]:
    """Where ``shown`` departs from ``written``: the changed part of ``written``."""
    same_start = _common_start(written, shown)
    same_end = _common_start(written[::-1], shown[::-1])
    same_end = min(same_end, min(len(written), len(shown)) - same_start)
    return same_start, len(written) - same_end


def _common_start(a: str, b: str) -> int:
    return sum(1 for _ in takewhile(lambda pair: pair[0] == pair[1], zip(a, b, strict=False)))
