"""model_summary: a session's older turns folded into a summary the model itself writes.

When a load of a model_summary session asks for a fold (the turns after the summary fill
most of their room), the router has the model rewrite the summary with the oldest of them,
in the background at the lowest priority the engine has (below every tier and the
mirror's shadows), and stores it with the context service's SaveSummary, which keeps it
only if the summary it replaces is still the stored one. Until it is stored, the session's
turns that no longer fit are left out, as keep_system_and_recent would. One fold per
session at a time, a few written at a time: a fold that finds the queue full is skipped,
and the next turn asks again.

What the model reads to write it was checked already (each turn on its way in, or it is
the model's own output, checked as it streamed); what it writes passes the tenant's
output rules before it is stored, as an answer would.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Protocol

from prometheus_client import Counter

from llmmesh.runtime.beside_loop import beside_loop_if_long
from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import Chunk, Fold, History, InferenceCall, Role, Sampling
from services.router.admission import SHADOW_PRIORITY
from services.router.prompt import build_prompt
from services.router.speech import ModelSpeech
from services.router.upstreams import InferenceClient, PolicyClient, RouteHints

log = logging.getLogger(__name__)

SUMMARY_PRIORITY = SHADOW_PRIORITY + 1  # after every tier (0-2) and the shadows
MAX_IN_FLIGHT = 2  # summaries the engine writes at once, at most
MAX_QUEUED = 256  # folds waiting for one of them (sessions), at most
# Worded for small models too: SmolLM2-135M, asked for a summary in prose, continues the
# transcript or talks of itself; asked for the facts as sentences about the user, it keeps
# most of them (bench/truncation.py measures what it keeps).
INSTRUCTIONS = "You summarize conversations."
REQUEST = (
    'Conversation:\n"""\n{transcript}\n"""\n\nList the facts stated in it (names, numbers, '
    "places, preferences, requests) as short sentences starting with 'The user'."
)

TRANSCRIPT_TURNS = ("\nUser:", "\nAssistant:")

SUMMARIES = Counter(
    "llm_router_model_summaries_total",
    "Summaries the model was asked to write, by outcome",
    ["model", "outcome"],
)
SUMMARY_TOKENS = Counter(
    "llm_router_model_summary_tokens_total",
    "Tokens the model read (prompt) and wrote (completion) for session summaries",
    ["model", "kind"],
)


class SummaryWriter(Protocol):
    async def save_summary(
        self, tenant: str, session_id: str, summary: str, *, covered: int, replaces: int,
        ttl_s: int,
    ) -> bool: ...  # fmt: skip


@dataclass(frozen=True)
class FoldJob:
    """A fold a load asked for, with what writing it needs."""

    tenant: str
    session_id: str
    request_id: str  # of the request whose load asked (the summary's is derived from it)
    model: str
    fold: Fold
    speech: ModelSpeech  # the model's own (its whole context: the summary is not a turn)
    rule_set: str  # the tenant's output rules, as its request's input check named them
    version: str
    ttl_s: int
    priority: int | None = SUMMARY_PRIORITY  # None: the engine does not order by priority
    cache_salt: str = ""  # the tenant's prefix-cache partition


def transcript(fold: Fold) -> str:
    """What the model is asked to fold: the summary so far, then the turns."""
    lines = [f"Summary so far: {fold.summary}"] if fold.summary else []
    names = {Role.USER: "User", Role.ASSISTANT: "Assistant", Role.SYSTEM: "System"}
    lines += [f"{names[t.role]}: {t.text}" for t in fold.turns]
    return "\n".join(lines)


class Summarizer:
    def __init__(
        self,
        inference: InferenceClient,
        writer: SummaryWriter,
        policy: PolicyClient,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self._inference = inference
        self._writer = writer
        self._policy = policy
        self._writing = asyncio.Semaphore(max_in_flight)
        self._queued: dict[tuple[str, str], asyncio.Task[None]] = {}

    def fold(self, job: FoldJob) -> None:
        """Queues the fold, written in the background ``max_in_flight`` at a time; not if
        one is queued for the session already or MAX_QUEUED are (the next turn asks
        again)."""
        key = (job.tenant, job.session_id)
        if key in self._queued or len(self._queued) >= MAX_QUEUED:
            SUMMARIES.labels(job.model, "skipped").inc()
            return
        task = asyncio.get_running_loop().create_task(self._write(job))
        self._queued[key] = task
        task.add_done_callback(lambda _: self._queued.pop(key, None))

    async def _write(self, job: FoldJob) -> None:
        try:
            async with self._writing:
                outcome = await self._written(job)
        except Exception as err:  # a summary is an optimisation: the turn went on without it
            log.warning("a session summary failed", extra={"fields": {"error": repr(err)}})
            outcome = "failed"
        SUMMARIES.labels(job.model, outcome).inc()

    async def _written(self, job: FoldJob) -> str:
        fold, speech = job.fold, job.speech
        # Built and counted beside the loop when long: a history near the model's context
        # is tens of KB, a tokenizer's 0.1 s on the loop every other stream would wait for.
        prompt, prompt_tokens = await beside_loop_if_long(
            _fold_chars(fold), functools.partial(_counted_prompt, fold, speech)
        )
        # A model that goes on with the transcript instead is stopped where it would.
        sampling = Sampling(
            max_tokens=max(fold.max_tokens, 1), temperature=0.0, stop=TRANSCRIPT_TURNS
        )
        call = InferenceCall(
            f"{job.request_id}-summary", job.model, prompt, sampling, job.priority, job.cache_salt
        )
        hints = RouteHints(f"{job.tenant}/{job.session_id}", tier="background", background=True)
        SUMMARY_TOKENS.labels(job.model, "prompt").inc(prompt_tokens)
        text, written = await _collect(self._inference.generate(call, hints))
        SUMMARY_TOKENS.labels(job.model, "completion").inc(written)
        guard = self._policy.guard_output(call.request_id, job.tenant, job.rule_set, job.version)
        try:
            checked = await guard.check(text, True)
        finally:
            await guard.close()
        if checked.denied_by is not None or not checked.text.strip():
            return "refused" if checked.denied_by else "empty"
        saved = await self._writer.save_summary(
            job.tenant, job.session_id, checked.text.strip(),
            covered=fold.through, replaces=fold.covered, ttl_s=job.ttl_s,
        )  # fmt: skip
        return "saved" if saved else "stale"


def _fold_chars(fold: Fold) -> int:
    return len(fold.summary) + sum(len(t.text) for t in fold.turns)


def _counted_prompt(fold: Fold, speech: ModelSpeech) -> tuple[str, int]:
    """The prompt and the tokens the model reads for it."""
    prompt = _prompt(fold, speech)
    return prompt, speech.count(prompt) + speech.bos_tokens


def _prompt(fold: Fold, speech: ModelSpeech) -> str:
    """The request to write the summary, in the model's chat layout; a transcript longer
    than the model's context loses its oldest turns (they are folded away regardless)."""
    room = speech.max_context - fold.max_tokens - speech.bos_tokens
    instructions = History(system_prompt=INSTRUCTIONS)
    turns = fold.turns
    while True:
        text = REQUEST.format(transcript=transcript(replace(fold, turns=turns)))
        try:
            return build_prompt(instructions, text, room, speech.count, speech.layout)[0]
        except InvalidArgument:
            if not turns:
                raise
            turns = turns[1:]


async def _collect(chunks: AsyncIterator[Chunk]) -> tuple[str, int]:
    """The text and its tokens."""
    parts, tokens = [], 0
    async for chunk in chunks:
        parts.append(chunk.text)
        tokens += chunk.num_tokens
    return "".join(parts), tokens
