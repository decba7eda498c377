"""Texts read as one: joined with a line break between each two (which the keyword view
skips like any separator and a pattern sees as whitespace, so a phrase split across two
of them is still found), and which of them a position of the whole lies in."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

SEPARATOR = "\n"


class Joined:
    """``texts`` joined, and where each starts in the whole."""

    __slots__ = ("starts", "text")

    def __init__(self, texts: Sequence[str]) -> None:
        self.text = SEPARATOR.join(texts)
        self.starts: list[int] = []
        offset = 0
        for text in texts:
            self.starts.append(offset)
            offset += len(text) + len(SEPARATOR)

    def index_at(self, position: int) -> int:
        """Which text the whole's ``position`` lies in (a separator: the text before)."""
        return bisect.bisect_right(self.starts, position) - 1
