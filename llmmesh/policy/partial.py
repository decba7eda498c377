"""The prefix language of a regular expression, as an RE2 pattern: it matches every text
that some longer text could extend into a match (and, since assertions such as ``\\b``
are dropped, a little more). The streamed output check holds back a tail it matches.

Built from the parse tree of Python's ``re`` parser, whose syntax RE2 shares for all that
RE2 accepts: prefix(A B) = prefix(A) | A prefix(B); prefix(A|B) = prefix(A) | prefix(B);
prefix(X{m,n}) = X{0,n-1} prefix(X). The result needs no backtracking either.
"""

from __future__ import annotations

import re
import re._constants as sre  # type: ignore[import-not-found]
import re._parser as sre_parse  # type: ignore[import-not-found]
from typing import Any

_CATEGORIES = {
    sre.CATEGORY_DIGIT: r"\d",
    sre.CATEGORY_NOT_DIGIT: r"\D",
    sre.CATEGORY_SPACE: r"\s",
    sre.CATEGORY_NOT_SPACE: r"\S",
    sre.CATEGORY_WORD: r"\w",
    sre.CATEGORY_NOT_WORD: r"\W",
}
_FLAGS = {re.IGNORECASE: "i", re.MULTILINE: "m", re.DOTALL: "s"}
_MAX_REPEAT = 1000  # RE2's limit


class Unsupported(ValueError):
    pass


def prefix_pattern(pattern: str) -> str | None:
    """The prefix language of ``pattern`` in RE2 syntax; None if it cannot be derived
    (the caller then holds back by width)."""
    try:
        parsed = sre_parse.parse(pattern)
        flags = "".join(c for f, c in _FLAGS.items() if parsed.state.flags & f)
        body = _prefix(list(parsed))
    except (re.error, Unsupported, RecursionError, OverflowError):
        return None
    return f"(?{flags}:{body})" if flags else body


def _prefix(items: list[tuple[Any, Any]]) -> str:
    """prefix(A1 A2 ... An) = prefix(A1) | A1 prefix(A2 ... An)."""
    items = [i for i in items if i[0] is not sre.AT]  # assertions dropped: a superset
    if not items:
        return ""
    head, rest = items[0], items[1:]
    first = _prefix_one(head)
    if not rest:
        return first
    return f"(?:{first}|{_full(head)}{_prefix(rest)})"


def _prefix_one(item: tuple[Any, Any]) -> str:
    op, arg = item
    if op in (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN):
        return f"(?:{_full(item)})?"
    if op is sre.BRANCH:
        return "(?:" + "|".join(_prefix(list(b)) for b in arg[1]) + ")"
    if op is sre.SUBPATTERN:
        _group, add, _remove, inner = arg
        return _scoped(add, _prefix(list(inner)))
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
        _low, high, inner = arg
        if high == 0:
            return ""
        body = _full_seq(list(inner))
        more = "*" if high is sre.MAXREPEAT or high > _MAX_REPEAT else f"{{0,{high - 1}}}"
        return f"(?:(?:{body}){more}{_prefix(list(inner))})"
    raise Unsupported(str(op))


def _full(item: tuple[Any, Any]) -> str:
    op, arg = item
    if op is sre.LITERAL:
        return re.escape(chr(arg))
    if op is sre.NOT_LITERAL:
        return f"[^{_class_char(arg)}]"
    if op is sre.ANY:
        return "(?s:.)"
    if op is sre.IN:
        return _class(arg)
    if op is sre.AT:
        return ""
    if op is sre.BRANCH:
        return "(?:" + "|".join(_full_seq(list(b)) for b in arg[1]) + ")"
    if op is sre.SUBPATTERN:
        _group, add, _remove, inner = arg
        return _scoped(add, _full_seq(list(inner)))
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
        low, high, inner = arg
        top = "" if high is sre.MAXREPEAT or high > _MAX_REPEAT else str(high)
        return f"(?:{_full_seq(list(inner))}){{{min(low, _MAX_REPEAT)},{top}}}"
    if op is sre.CATEGORY:
        return _CATEGORIES[arg]
    raise Unsupported(str(op))


def _full_seq(items: list[tuple[Any, Any]]) -> str:
    return "".join(_full(i) for i in items)


def _scoped(flags: int, body: str) -> str:
    letters = "".join(c for f, c in _FLAGS.items() if flags & f)
    return f"(?{letters}:{body})" if letters else f"(?:{body})"


def _class(items: list[tuple[Any, Any]]) -> str:
    parts, negate = [], False
    for op, arg in items:
        if op is sre.NEGATE:
            negate = True
        elif op is sre.LITERAL:
            parts.append(_class_char(arg))
        elif op is sre.RANGE:
            parts.append(f"{_class_char(arg[0])}-{_class_char(arg[1])}")
        elif op is sre.CATEGORY:
            parts.append(_CATEGORIES[arg])
        else:
            raise Unsupported(str(op))
    return f"[{'^' if negate else ''}{''.join(parts)}]"


def _class_char(code: int) -> str:
    char = chr(code)
    return "\\" + char if char in "\\]^-[" else char
