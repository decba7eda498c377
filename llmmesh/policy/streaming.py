"""The streamed output check: generated text goes in chunk by chunk; text that can no
longer be part of a match comes out, redacted, and a deny rule stops the stream.

Only the tail that may still grow into a match is held back (the matchers say which; see
Matcher.settled_until), so the work per chunk is bounded by that tail plus the chunk,
however long the stream has run. Streaming any split of a text gives exactly what
checking the whole text at once gives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from llmmesh.policy.matching import Hit, Views, held_whole
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


class _Junction:
    """The matches that the client's text before an output (its ``lead``: a continued
    message, a completion's prompt) begins and the output ends: the lead's last
    characters and the output's first, read as one text."""

    def __init__(self, rules: StageRules, lead: str) -> None:
        self._matcher = rules.matcher
        # As much of the lead as a streamed match can span, and the context before it.
        self._lead = lead[-(self._matcher.holdback_cap + MAX_IGNORED_RUN + 1) :]

    def step(self, output: str, final: bool) -> tuple[list[Hit], int, bool]:
        """For ``output`` so far: the matches that span the junction, as their parts in the
        output; how much of the output is settled for them; and whether none can be found
        any more once those are applied."""
        text, at = self._lead + output, len(self._lead)
        views = Views(text)
        hits = self._matcher.spanning(views, at)
        settled = len(text) if final else self._matcher.settled_until(views, 0, hits)
        spanning = [replace(h, start=0, end=h.end - at) for h in hits]
        return spanning, max(settled - at, 0), settled >= at


class OutputScanner:
    """``lead``: text the output continues that is not the model's (a continued message,
    a completion's prompt). The output is checked as without it, and a match that the lead
    begins and the output ends decides too (a deny; a redaction of its part in the
    output): the lead only adds matches, and it is never released."""

    def __init__(self, rules: StageRules, lead: str = "") -> None:
        self._rules = rules
        self._junction = _Junction(rules, lead) if lead and rules else None
        self._head = ""  # the output so far, while the junction may still hold a match
        # The end of the released text: word boundaries need the character before new
        # text, and that character may be followed by ignored ones (zero-width, marks).
        self._context = ""
        self._pending = ""
        self.matched: list[str] = []  # every rule that matched so far, first match first
        self.denied_by: str | None = None
        self._fed = 0  # characters fed so far
        self._tokens = 0  # tokens fed so far
        # Per chunk still (partly) held: where it ends, and the tokens fed with it.
        self._chunks: deque[tuple[int, int]] = deque()

    def feed(self, text: str, tokens: int = 1) -> OutputStep:
        """The check of ``text`` (``tokens`` generated tokens) after what came before; with
        the rules' holdback_tokens, text that has waited that many tokens goes out as it
        is."""
        if self._junction is not None:
            self._head += text
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
            self._pending = ""
            return OutputStep(pending)
        scan, pos = self._context + pending, len(self._context)
        matcher, views = self._rules.matcher, Views(scan)
        hits = matcher.hits(views, pos)
        settled = len(scan) if final else matcher.settled_until(views, pos, hits)
        if self._junction is not None:
            hits, settled = self._with_junction(
                self._junction, hits, pos, settled, len(pending), final=final
            )
        if not hits:  # most chunks: the settled text goes out as it came
            return OutputStep(scan[pos:settled], held=self._settle(scan, pos, settled))
        # A deny match that is certain stops the stream at once, even while held back.
        read = matcher.read_until(scan)
        decided = [h for h in hits if h.start < settled or self._certain_deny(h, read)]
        decision = self._rules.decide(scan[pos:settled], decided, pos)
        new = tuple(r for r in decision.rule_ids if r not in self.matched)
        self.matched += new
        if decision.denied_by is not None:
            self.denied_by, self._pending = decision.denied_by, ""
            return OutputStep("", new, decision.denied_by)
        held = self._settle(scan, pos, settled)
        return OutputStep(decision.text, new, None, held, decision.redacted)

    def _with_junction(
        self,
        junction: _Junction,
        hits: list[Hit],
        pos: int,
        settled: int,
        pending: int,
        *,
        final: bool,
    ) -> tuple[list[Hit], int]:
        """The step's matches with those spanning the lead's end (in the scanned text's
        positions), and what is settled for both; the junction is dropped once it can
        find no more. ``pending``: the characters held and new in this step."""
        spanning, junction_settled, over = junction.step(self._head, final)
        released = len(self._head) - pending  # output characters before ``pos``
        shift = pos - released
        found = [
            replace(h, start=max(h.start + shift, pos), end=h.end + shift)
            for h in spanning
            if h.end > released
        ]
        hits = [*hits, *found]
        settled = held_whole(min(settled, max(junction_settled + shift, pos)), hits)
        if over and all(h.end <= settled for h in found):
            self._junction, self._head = None, ""
        return hits, settled

    def _settle(self, scan: str, pos: int, settled: int) -> int:
        """Keeps the text after ``settled`` back and the context before it; how much is
        held."""
        if settled > pos:
            self._context = scan[max(settled - MAX_IGNORED_RUN - 1, 0) : settled]
        self._pending = scan[settled:]
        return len(self._pending)


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
