"""The streamed output check: generated text goes in chunk by chunk; text that can no
longer be part of a match comes out, redacted, and a deny rule stops the stream.

Only the tail that may still grow into a match is held back (the matchers say which; see
Matcher.settled_until), so the work per chunk is bounded by that tail plus the chunk,
however long the stream has run. Streaming any split of a text gives exactly what
checking the whole text at once gives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from llmmesh.policy.matching import Hit, Views
from llmmesh.policy.normalize import MAX_IGNORED_RUN
from llmmesh.policy.rules import StageRules
from llmmesh.types import PolicyAction


@dataclass(frozen=True)
class OutputStep:
    """What one chunk released: text (``redacted`` if a rule replaced some of it), rules
    that matched for the first time, the deny rule that stops the stream (nothing is
    released then), and how much is held back."""

    text: str
    rule_ids: tuple[str, ...] = ()
    denied_by: str | None = None
    held: int = 0
    redacted: bool = False

    def then(self, later: OutputStep) -> OutputStep:
        """This step followed by ``later``, as one."""
        return OutputStep(
            self.text + later.text,
            self.rule_ids + later.rule_ids,
            later.denied_by,
            later.held,
            self.redacted or later.redacted,
        )


class OutputScanner:
    """``lead``: text the model's output continues that is not the model's (a continued
    message, a completion's prompt): the rules read it before the output, so that a match
    it begins and the model ends is found; a match within it is not the model's, and it
    is never released (a redaction spanning its end replaces the output's part). Only its
    last characters count, as many as the check may hold back: a longer match is not
    found in a stream either."""

    def __init__(self, rules: StageRules, lead: str = "") -> None:
        self._rules = rules
        cut = max(0, len(lead) - rules.matcher.holdback_cap) if rules else len(lead)
        # The end of the released text: word boundaries need the character before new
        # text, and that character may be followed by ignored ones (zero-width, marks).
        self._context = lead[max(0, cut - MAX_IGNORED_RUN - 1) : cut]
        lead = lead[cut:]
        self._pending = lead
        self._hidden = len(lead)  # the lead's characters still held, first in _pending
        self.matched: list[str] = []  # every rule that matched so far, first match first
        self.denied_by: str | None = None
        self._fed = len(lead)  # characters fed so far
        self._tokens = 0  # tokens fed so far
        # Per chunk still (partly) held: where it ends, and the tokens fed with it.
        self._chunks: deque[tuple[int, int]] = deque([(len(lead), 0)] if lead else ())

    def feed(self, text: str, tokens: int = 1) -> OutputStep:
        """The check of ``text`` (``tokens`` generated tokens) after what came before; with
        the rules' holdback_tokens, text that has waited that many tokens goes out as it
        is."""
        limit = self._rules.holdback_tokens
        if limit is None:  # no bound in tokens: nothing to count
            return self._step(self._pending + text, final=False)
        self._fed += len(text)
        self._tokens += tokens
        self._chunks.append((self._fed, self._tokens))
        step = self._step(self._pending + text, final=False)
        held_from = self._fed - len(self._pending)
        while self._chunks and self._chunks[0][0] <= held_from:  # released whole
            self._chunks.popleft()
        if not self._pending or step.denied_by is not None:
            return step
        # The oldest held character came with the first chunk left: tokens since then.
        if self._tokens - self._chunks[0][1] < limit:
            return step
        self._chunks.clear()
        return step.then(self._step(self._pending, final=True))

    def finish(self) -> OutputStep:
        """Releases what is still held: the stream has ended."""
        return self._step(self._pending, final=True)

    def _certain_deny(self, hit: Hit, scanned: int) -> bool:
        return hit.certain and hit.valid and hit.end < scanned and self._rules.denies(hit.rule)

    def _step(self, pending: str, final: bool) -> OutputStep:
        if self.denied_by is not None:
            return OutputStep("", denied_by=self.denied_by)
        if not self._rules:
            visible = pending[self._hidden :]
            self._pending, self._hidden = "", 0
            return OutputStep(visible)
        scan, pos = self._context + pending, len(self._context)
        matcher, views = self._rules.matcher, Views(scan)
        hits = matcher.hits(views, pos)
        if self._hidden:  # a match within the lead is not the model's
            hits = [h for h in hits if h.end > pos + self._hidden]
        settled = len(scan) if final else matcher.settled_until(views, pos, hits)
        shown = pos + min(self._hidden, settled - pos)  # where released text is shown from
        if not hits:  # most chunks: the settled text goes out as it came
            return OutputStep(scan[shown:settled], held=self._settle(scan, pos, settled))
        # A deny match that is certain stops the stream at once, even while held back.
        decided = [h for h in hits if h.start < settled or self._certain_deny(h, len(scan))]
        decision = self._rules.decide(scan[pos:settled], decided, pos)
        new = tuple(r for r in decision.rule_ids if r not in self.matched)
        self.matched += new
        if decision.denied_by is not None:
            self.denied_by, self._pending = decision.denied_by, ""
            return OutputStep("", new, decision.denied_by)
        if shown > pos:  # the lead's part goes unreleased: only what follows is redacted
            decision = self._rules.decide(scan[shown:settled], _after(decided, shown), shown)
        held = self._settle(scan, pos, settled)
        return OutputStep(decision.text, new, None, held, decision.redacted)

    def _settle(self, scan: str, pos: int, settled: int) -> int:
        """Keeps the text after ``settled`` back and the context before it; how much of
        the output is held."""
        if settled > pos:
            self._context = scan[max(settled - MAX_IGNORED_RUN - 1, 0) : settled]
        self._hidden = max(0, self._hidden - (settled - pos))
        self._pending = scan[settled:]
        return len(self._pending) - self._hidden


def _after(hits: Sequence[Hit], start: int) -> list[Hit]:
    """The parts of ``hits`` from ``start`` on."""
    return [replace(h, start=max(h.start, start)) for h in hits if h.end > start]


@dataclass(frozen=True)
class OutputDecision:
    """What a generation's check decided, for the audit trail."""

    action: PolicyAction
    rule_ids: tuple[str, ...]  # every rule that matched, first match first
    text: str  # the whole output, when it is kept; otherwise empty


class StreamCheck:
    """One generation's check: chunks go in (``final`` with the last), and the decision
    goes to ``on_decision`` once: when the stream ends, is denied, or is cut short."""

    def __init__(
        self,
        rules: StageRules,
        on_decision: Callable[[OutputDecision], None],
        keep_text: bool = False,
        lead: str = "",
    ) -> None:
        """``lead``: text the output continues (OutputScanner's); the decision's text is
        the model's alone."""
        self._scanner = OutputScanner(rules, lead)
        self._on_decision = on_decision
        self._text: list[str] | None = [] if keep_text else None
        self._redacted = False
        self._closed = False

    def feed(self, text: str, final: bool = False, tokens: int = 1) -> OutputStep:
        step = self._scanner.feed(text, tokens)
        if final and step.denied_by is None:
            step = step.then(self._scanner.finish())
        if self._text is not None:
            self._text.append(text)
        self._redacted = self._redacted or step.redacted
        if final or step.denied_by is not None:
            self.close()
        return step

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._scanner.denied_by is not None:
            action = PolicyAction.DENY
        else:
            action = PolicyAction.REDACT if self._redacted else PolicyAction.ALLOW
        text = "".join(self._text or ())
        self._on_decision(OutputDecision(action, tuple(self._scanner.matched), text))
