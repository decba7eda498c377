"""A tool-calling answer streamed as OpenAI's deltas while the model writes its JSON
(``services/router/tool_calls.py`` says what that JSON is). An answer in words goes out
decoded from its JSON string as it comes; each call goes out as its name is whole, then
its arguments as they are written, as OpenAI streams them. The grammar writes the JSON in
one layout (the engine's separators, the schema's key order), which is what is read here;
text that leaves it (changed by an output rule) goes out as content at the end.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from services.router.tool_calls import ANSWER, CALLS, answer_of, call_id

Delta = dict[str, Any]

_ANSWER_START = "{" + json.dumps(ANSWER) + ': "'
_CALLS_START = "{" + json.dumps(CALLS) + ": ["
_CALL_START = '{"name": '
_ARGUMENTS = ', "arguments": '
_NEXT_CALL, _END = ", ", "]}"
# The states that only pass a literal of the layout: the literal, and the state after it.
_LITERALS = {"call": (_CALL_START, "name"), "arguments": (_ARGUMENTS, "value")}
_HIGH = frozenset("89abAB")  # a high surrogate's second hex digit: D800-DBFF


class ToolStream:
    """One choice's deltas, fed its text as it comes; ``new_id`` names each call."""

    def __init__(self, new_id: Callable[[], str] = call_id) -> None:
        self._text = ""
        self._reader: _AnswerReader | _CallsReader | None = None
        self._new_id = new_id

    def feed(self, text: str) -> list[Delta]:
        self._text += text
        if self._reader is None:
            self._reader = _reader_for(self._text, self._new_id)
        return self._reader.read(self._text) if self._reader is not None else []

    def end(self) -> tuple[list[Delta], list[Delta]]:
        """The last deltas, and the calls made."""
        if isinstance(self._reader, _AnswerReader):
            return [], []
        calls = self._reader.calls if self._reader is not None else []
        if calls:
            return self._reader.rest(self._text) if self._reader else [], calls
        content, calls = answer_of(
            self._text, self._new_id
        )  # not the tools' JSON, or cut before a call
        if calls:
            return [{CALLS: [{"index": i, **call} for i, call in enumerate(calls)]}], calls
        return ([{"content": content}] if content else []), []


def whole_answer(text: str, new_id: Callable[[], str] = call_id) -> tuple[str | None, list[Delta]]:
    """The content and the calls of a whole answer, read as a streamed one is (the same
    arguments' text either way)."""
    stream = ToolStream(new_id)
    deltas = stream.feed(text)
    last, calls = stream.end()
    content = "".join(d["content"] for d in deltas + last if "content" in d)
    return (None if calls and not content else content), calls


def _reader_for(text: str, new_id: Callable[[], str]) -> _AnswerReader | _CallsReader | None:
    if text.startswith(_ANSWER_START):
        return _AnswerReader(len(_ANSWER_START))
    if text.startswith(_CALLS_START):
        return _CallsReader(len(_CALLS_START), new_id)
    if any(start.startswith(text) for start in (_ANSWER_START, _CALLS_START)):
        return None  # not yet known
    return _CallsReader(len(text), new_id, lost=True)  # neither: held to the end


class _AnswerReader:
    def __init__(self, at: int) -> None:
        self._at = at  # the answer's next undecoded character
        self._closed = False  # the answer's string has ended

    def read(self, text: str) -> list[Delta]:
        if self._closed:
            return []
        decoded = self._decode(text)
        return [{"content": decoded}] if decoded else []

    def _decode(self, text: str) -> str:
        """The answer's characters complete so far (an escape is decoded once whole)."""
        start = at = self._at
        while at < len(text):
            if text[at] == '"':
                self._closed = True
                break
            width = _escape_width(text, at) if text[at] == "\\" else 1
            if width == 0:
                break
            at += width
        self._at = at
        try:
            return str(json.loads(f'"{text[start:at]}"'))
        except ValueError:  # not the grammar's JSON (an output rule changed it): as it is
            return text[start:at]


class _CallsReader:
    """Reads calls from ``at``: each one's name, then its arguments' text as it comes, up
    to the brace that closes the call (outside any string, at the call's own depth)."""

    def __init__(self, at: int, new_id: Callable[[], str], lost: bool = False) -> None:
        self.calls: list[Delta] = []
        self._new_id = new_id
        self._at = at
        self._state = "lost" if lost else "call"
        self._depth = 0  # brackets open within the arguments
        self._in_string = False
        self._escaped = False

    def read(self, text: str) -> list[Delta]:
        deltas: list[Delta] = []
        while self._state not in ("lost", "done"):
            if self._state in _LITERALS:
                step = self._expect(text, *_LITERALS[self._state])
            else:
                step = getattr(self, f"_{self._state}")(text)
            if step is None:
                break
            deltas += step
        return deltas

    def rest(self, text: str) -> list[Delta]:
        """What is left once the JSON ends: text past the layout, as content."""
        if self._state != "lost" or self._at >= len(text):
            return []
        return [{"content": text[self._at :]}]

    def _literal(self, text: str, literal: str) -> bool | None:
        """Past ``literal`` if it is next (True); None: not all here yet."""
        got = text[self._at : self._at + len(literal)]
        if got == literal:
            self._at += len(literal)
            return True
        if not literal.startswith(got):
            self._state = "lost"
            return False
        return None

    def _expect(self, text: str, literal: str, then: str) -> list[Delta] | None:
        """Past ``literal``, on to ``then``; None: not all here yet, or lost."""
        if not self._literal(text, literal):
            return None
        self._state = then
        return []

    def _name(self, text: str) -> list[Delta] | None:
        end = _string_end(text, self._at)
        if end == 0:
            return None
        try:
            name = json.loads(text[self._at : end])
        except ValueError:
            name = None
        if not isinstance(name, str):
            self._state = "lost"
            return None
        self._at = end
        self._state = "arguments"
        call = {
            "id": self._new_id(),
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        self.calls.append(call)  # its arguments grow as they come; the delta's stay empty
        header = {**call, "function": {"name": name, "arguments": ""}}
        return [{CALLS: [{"index": len(self.calls) - 1, **header}]}]

    def _value(self, text: str) -> list[Delta] | None:
        start = at = self._at
        while at < len(text) and self._state == "value":
            self._scan(text[at])
            at += 1
        written = text[start : at if self._state == "value" else at - 1]
        self._at = at
        call = self.calls[-1]
        call["function"]["arguments"] += written
        deltas = [{CALLS: [{"index": len(self.calls) - 1, "function": {"arguments": written}}]}]
        return deltas if written else ([] if self._state != "value" else None)

    def _scan(self, char: str) -> None:
        """One character of the arguments; the call's closing brace ends them."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]" and self._depth == 0:
            self._state = "after"
        elif char in "}]":
            self._depth -= 1

    def _after(self, text: str) -> list[Delta] | None:
        if text.startswith(_END, self._at):
            self._at += len(_END)
            self._state = "done"
            return []
        if text.startswith(_NEXT_CALL, self._at):
            self._at += len(_NEXT_CALL)
            self._state, self._depth = "call", 0
            return []
        rest = text[self._at :]
        if not any(literal.startswith(rest) for literal in (_END, _NEXT_CALL)):
            self._state = "lost"
        return None


def _string_end(text: str, at: int) -> int:
    """Where the JSON string starting at ``at`` ends (past its closing quote); 0: not yet."""
    if at >= len(text):
        return 0
    escaped = False
    for index in range(at + 1, len(text)):
        char = text[index]
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            return index + 1
    return 0


def _escape_width(text: str, at: int) -> int:
    """The characters of the escape at ``at`` (0: not all here yet). A high surrogate's
    escape is taken with the low one after it: JSON writes a character beyond the BMP as
    the pair."""
    if at + 1 >= len(text):
        return 0
    if text[at + 1] != "u":
        return 2
    if at + 6 > len(text):
        return 0
    if text[at + 2] not in "dD" or text[at + 3] not in _HIGH:
        return 6
    return 12 if at + 12 <= len(text) else 0
