"""Truncation strategies judged by what the model still knows (``llm-mesh bench --scenario
truncation``): bench/recall.py's conversations through the real mesh, on the real model,
once per strategy under a context budget that forces truncation and once whole.

For each strategy and conversation, a session of its own is seeded with the conversation
(through the context service, as an earlier conversation left it), continued by one more
exchange through the router (where model_summary's fold is asked for; the run waits for
the model to write it, up to a limit), then forked once per question, each asked through
the router greedily. A router with the model's whole context gives the reference answers;
one whose model context is the budget runs every strategy. Per strategy: fact retention,
the instruction's, ROUGE-L and BLEU-4 against the whole history's answer, prompt tokens,
the prefix cache's share of them, and TTFT.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families
from scipy import stats
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)
from tokenizers import Tokenizer

from bench.recall import Conversation, bleu4, conversations, obeyed, retained, rouge_l
from llmmesh.client import auth_metadata, build_request
from llmmesh.convert import turn_to_pb
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child
from llmmesh.launcher.tokenizer_dirs import write_tokenizer_dirs
from llmmesh.runtime.internal_auth import token_metadata
from llmmesh.types import Truncation
from llmmesh.v1 import context_pb2, context_pb2_grpc, generation_pb2_grpc
from services.context.truncation import STRATEGIES

WHOLE = "whole history"
TENANT = "demo"  # the local stack's tenant
CONTINUE = "Thanks. Let us go on."
SUMMARY_WAIT_S = 120.0
ASK_ATTEMPTS = 3


def _unavailable(err: BaseException) -> bool:
    return isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.UNAVAILABLE


@dataclass(frozen=True)
class Answer:
    conversation: str
    question: str
    text: str
    retained: bool
    obeyed: bool
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    # The fact reached the model: its turn was in the prompt, or the summary that stood
    # for it (sliding_summary's or model_summary's, as stored) states it. None for
    # key_sentences: the router chooses its excerpt per message, out of sight here.
    reached: bool | None

    @property
    def key(self) -> tuple[str, str]:
        return self.conversation, self.question


@dataclass
class StrategyRun:
    strategy: str
    answers: list[Answer] = field(default_factory=list)
    summaries_missing: int = 0  # model_summary: folds not stored in time
    summaries: list[str] = field(default_factory=list)  # model_summary: what the model wrote
    summary_tokens: float = 0.0  # model_summary: tokens the model read and wrote for them


@dataclass(frozen=True)
class Row:
    strategy: str
    retention: float
    obeyed: float
    rouge_l: float
    bleu4: float
    prompt_tokens: float
    cache_hit: float
    ttft_p50_s: float
    answers: int
    summary_tokens: float  # per answer
    reached: float | None  # share of the facts that reached the model, where it is seen

    @property
    def counts(self) -> list[int]:
        """Answers that retained the fact, and that did not."""
        kept = round(self.retention * self.answers)
        return [kept, self.answers - kept]

    @property
    def cost(self) -> float:
        """Tokens the engine reads or writes per answer for the history: the prompt's and
        the summaries'."""
        return self.prompt_tokens + self.summary_tokens

    def markdown(self) -> str:
        return (
            f"| {self.strategy} | {_share(self.reached)} | {self.retention:.0%} | "
            f"{self.obeyed:.0%} | "
            f"{self.rouge_l:.3f} | {self.bleu4:.3f} | {self.prompt_tokens:.0f} | "
            f"{self.summary_tokens:.0f} | {self.cache_hit:.0%} | {self.ttft_p50_s * 1000:.0f} | "
            f"{self.answers} |"
        )


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def score(run: StrategyRun, reference: StrategyRun) -> Row:
    whole = {a.key: a.text for a in reference.answers}
    answers = run.answers
    prompt = sum(a.prompt_tokens for a in answers)
    return Row(
        run.strategy,
        retention=statistics.fmean(a.retained for a in answers),
        obeyed=statistics.fmean(a.obeyed for a in answers),
        rouge_l=statistics.fmean(
            rouge_l(a.text, whole[a.conversation, a.question]) for a in answers
        ),
        bleu4=statistics.fmean(bleu4(a.text, whole[a.conversation, a.question]) for a in answers),
        prompt_tokens=prompt / len(answers),
        cache_hit=sum(a.cached_tokens for a in answers) / prompt if prompt else 0.0,
        ttft_p50_s=statistics.median(a.ttft_s for a in answers),
        answers=len(answers),
        summary_tokens=run.summary_tokens / len(answers),
        reached=None
        if any(a.reached is None for a in answers)
        else statistics.fmean(bool(a.reached) for a in answers),
    )


def recommended(rows: list[Row]) -> tuple[Row, str]:
    """The default the table argues for, retention first, then cost: the strategy that
    retains the most facts, unless a cheaper one (fewer prompt and summary tokens)
    retains as many within chance (Fisher's exact test, one-sided, p >= 0.05); and why."""
    strategies = [r for r in rows if r.strategy != WHOLE]
    best = max(strategies, key=lambda r: (r.retention, -r.cost))
    for row in sorted(strategies, key=lambda r: r.cost):
        if row.cost >= best.cost:
            break
        p = float(stats.fisher_exact([best.counts, row.counts], alternative="greater").pvalue)
        if p >= 0.05:
            why = (
                f"retains {row.retention:.0%} against {best.strategy}'s {best.retention:.0%} "
                f"(Fisher p={p:.2f}: within chance) at {row.cost:.0f} tokens per answer "
                f"against {best.cost:.0f}"
            )
            return row, why
    return best, f"retains the most facts ({best.retention:.0%})"


def table(rows: list[Row]) -> str:
    head = (
        "| strategy | facts in the prompt | facts retained | instruction kept | ROUGE-L | "
        "BLEU-4 | prompt tokens | summary tokens | prefix cache hits | TTFT p50 (ms) | "
        "answers |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    return "\n".join([head, *(row.markdown() for row in rows)])


@dataclass(frozen=True)
class Reply:
    text: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    dropped_turns: int  # of the session's, left out of the prompt whole


class Mesh:
    """Clients of a router and of the context service, for one run's sessions."""

    def __init__(self, router: str, stack: Stack, count: Callable[[str], int]) -> None:
        self._router = grpc.aio.insecure_channel(router)
        self._context = grpc.aio.insecure_channel(stack.address("context"))
        self._generation = generation_pb2_grpc.GenerationStub(self._router)
        self._sessions = context_pb2_grpc.ContextStub(self._context)
        self._auth = auth_metadata(stack.api_key)
        self._internal = token_metadata(stack.internal_token)
        self._count = count
        self.retries = 0  # requests sent again after UNAVAILABLE

    async def close(self) -> None:
        await self._router.close()
        await self._context.close()

    async def seed(self, session_id: str, conversation: Conversation) -> None:
        """The session as an earlier conversation left it."""
        await self._sessions.PutSession(
            context_pb2.PutSessionRequest(
                tenant=TENANT, session_id=session_id, system_prompt=conversation.system_prompt
            ),
            metadata=self._internal,
        )
        turns = [
            turn_to_pb(replace(turn, token_count=self._count(turn.text)))
            for turn in conversation.turns
        ]
        await self._sessions.AppendTurns(
            context_pb2.AppendTurnsRequest(
                tenant=TENANT, session_id=session_id, request_id=f"{session_id}-seed", turns=turns
            ),
            metadata=self._internal,
        )

    async def ask(self, session_id: str, prompt: str, strategy: str, max_tokens: int) -> Reply:
        """The router's answer; a request the mesh could not serve right then (UNAVAILABLE:
        a dependency slow on a busy machine) is sent again, at most ASK_ATTEMPTS times in
        all, and counted: one such failure must not void an hour's run."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(ASK_ATTEMPTS),
            wait=wait_exponential(multiplier=0.5, max=5),
            retry=retry_if_exception(_unavailable),
            before_sleep=self._count_retry,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._ask(session_id, prompt, strategy, max_tokens)
        raise AssertionError("tenacity ended without an outcome")  # pragma: no cover

    def _count_retry(self, state: RetryCallState) -> None:
        self.retries += 1

    async def _ask(self, session_id: str, prompt: str, strategy: str, max_tokens: int) -> Reply:
        request = build_request(
            prompt, model="smollm2", max_tokens=max_tokens, temperature=0.0,
            session_id=session_id, truncation=strategy,
        )  # fmt: skip
        sent, first, parts = time.perf_counter(), 0.0, []
        usage, dropped = None, 0
        async for reply in self._generation.Generate(request, metadata=self._auth, timeout=600):
            if reply.text and not first:
                first = time.perf_counter()
            if reply.HasField("context"):
                dropped = reply.context.dropped_turns
            parts.append(reply.text)
            if reply.finish_reason:
                usage = reply.usage
        return Reply(
            "".join(parts),
            usage.prompt_tokens if usage is not None else 0,
            usage.cached_tokens if usage is not None else 0,
            (first or time.perf_counter()) - sent,
            dropped,
        )

    async def fork(self, source: str, session_id: str, system_prompt: str) -> None:
        await self._sessions.ForkSession(
            context_pb2.ForkSessionRequest(
                tenant=TENANT, source_session_id=source, session_id=session_id,
                system_prompt=system_prompt,
            ),
            metadata=self._internal,
        )  # fmt: skip

    async def summary(self, session_id: str) -> str:
        """The model's summary of the session's older turns, once it is stored."""
        load = context_pb2.LoadSessionRequest(
            tenant=TENANT, session_id=session_id, budget_tokens=1 << 30,
            truncation=Truncation.MODEL_SUMMARY,
        )  # fmt: skip
        reply = await self._sessions.LoadSession(load, metadata=self._internal)
        return str(reply.summary)


async def _until(read: Callable[[], Awaitable[str]], timeout_s: float) -> str:
    """What ``read`` returns once it is not empty ("" after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not (value := await read()):
        if time.monotonic() > deadline:
            return ""
        await asyncio.sleep(0.5)  # the model writes a summary in seconds: polled for it
    return value


@dataclass(frozen=True)
class Pass:
    """One pass of every conversation through a router."""

    mesh: Mesh
    run_id: str
    max_tokens: int
    concurrency: int


async def run_strategy(
    run: Pass, strategy: str, talks: list[Conversation], label: str = ""
) -> StrategyRun:
    """Every conversation's questions under ``strategy``, ``run.concurrency`` at a time."""
    result = StrategyRun(label or strategy)
    gate = asyncio.Semaphore(run.concurrency)
    mesh = run.mesh

    async def one(conversation: Conversation) -> None:
        # One conversation after another per slot: its questions follow its last turn
        # as a user's would, while the engine still holds that turn's prefix.
        async with gate:
            session = f"{run.run_id}-{result.strategy.replace(' ', '-')}-{conversation.id}"
            await mesh.seed(session, conversation)
            await mesh.ask(session, CONTINUE, strategy, 1)
            if strategy == Truncation.MODEL_SUMMARY:
                written = await _until(lambda: mesh.summary(session), SUMMARY_WAIT_S)
                result.summaries.append(written)
                result.summaries_missing += not written
            for i, fact in enumerate(conversation.facts):
                asked = f"{session}-q{i}"
                await mesh.fork(session, asked, conversation.system_prompt)
                reply = await mesh.ask(asked, fact.question, strategy, run.max_tokens)
                summary = await mesh.summary(asked)
                reached: bool | None = reply.dropped_turns <= conversation.turn_of(
                    fact
                ) or retained(summary, fact)
                if strategy == Truncation.KEY_SENTENCES and not reached:
                    reached = None  # the excerpt the router chose is not seen here
                result.answers.append(
                    Answer(conversation.id, fact.question, reply.text, retained(reply.text, fact),
                           obeyed(reply.text, conversation.marker), reply.prompt_tokens,
                           reply.cached_tokens, reply.ttft_s, reached)
                )  # fmt: skip

    await asyncio.gather(*(one(c) for c in talks))
    return result


@dataclass(frozen=True)
class Settings:
    conversations: int = 50
    seed: int = 0
    budget_tokens: int = 512  # the model's context as the truncating router sees it
    max_tokens: int = 24
    filler_rounds: int = 16
    concurrency: int = 4
    strategies: tuple[str, ...] = tuple(STRATEGIES)


@dataclass
class Evaluation:
    settings: Settings
    whole: StrategyRun
    runs: list[StrategyRun]
    seconds: float
    retries: int = 0  # requests sent again after UNAVAILABLE (Mesh.ask)

    def rows(self) -> list[Row]:
        return [score(self.whole, self.whole), *(score(r, self.whole) for r in self.runs)]

    def as_json(self) -> dict[str, object]:
        """Every answer and summary, for a look at what the numbers stand for."""
        return {
            "settings": asdict(self.settings),
            "runs": [asdict(run) for run in (self.whole, *self.runs)],
        }


@dataclass(frozen=True)
class Routers:
    whole: str  # the stack's router: the model's whole context
    cut: str  # one whose model context is the budget, over the same replicas
    cut_metrics: str

    def summary_tokens(self) -> float:
        """Tokens the budget's router had the model read and write for summaries."""
        with urllib.request.urlopen(self.cut_metrics, timeout=10) as reply:
            text = reply.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "llm_router_model_summary_tokens_total"
        )


@contextmanager
def _routers(stack: Stack, workdir: Path, budget_tokens: int) -> Iterator[Routers]:
    ports = StackPorts.free()
    child: Child = stack.start_service(
        "router", ports.router, workdir, model_context_tokens=str(budget_tokens),
        metrics_port=str(ports.router_metrics),
    )  # fmt: skip
    try:
        metrics = f"http://127.0.0.1:{ports.router_metrics}/metrics"
        yield Routers(stack.address("router"), f"127.0.0.1:{ports.router}", metrics)
    finally:
        child.terminate(10)


def evaluate(workdir: Path, settings: Settings) -> Evaluation:
    """Starts a stack serving smollm2 and runs the evaluation through it."""
    with Stack(workdir / "stack", StackPorts.free(), models=["smollm2"]) as stack:
        return evaluate_on(stack, workdir, settings)


def evaluate_on(stack: Stack, workdir: Path, settings: Settings) -> Evaluation:
    """The evaluation through ``stack`` (serving smollm2), with a router of its own for
    the budget."""
    started = time.monotonic()
    talks = conversations(settings.conversations, settings.seed, settings.filler_rounds)
    tokenizer_dir = write_tokenizer_dirs(
        stack.address("inference"), stack.internal_token, ["smollm2"], workdir
    )["smollm2"]
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    with _routers(stack, workdir, settings.budget_tokens) as routers:
        whole, runs, retries = asyncio.run(_all(stack, settings, talks, routers, count))
    return Evaluation(settings, whole, runs, time.monotonic() - started, retries)


async def _all(
    stack: Stack, settings: Settings, talks: list[Conversation], routers: Routers,
    count: Callable[[str], int],
) -> tuple[StrategyRun, list[StrategyRun], int]:  # fmt: skip
    run_id = f"t{time.time_ns()}"
    full, cut = Mesh(routers.whole, stack, count), Mesh(routers.cut, stack, count)
    try:
        whole_pass = Pass(full, run_id, settings.max_tokens, settings.concurrency)
        cut_pass = Pass(cut, run_id, settings.max_tokens, settings.concurrency)
        # The whole context: nothing is cut, whatever the strategy.
        whole = await run_strategy(whole_pass, Truncation.LAST_TURNS, talks, WHOLE)
        runs = []
        for strategy in settings.strategies:
            before = routers.summary_tokens()
            runs.append(await run_strategy(cut_pass, strategy, talks))
            runs[-1].summary_tokens = routers.summary_tokens() - before
    finally:
        await full.close()
        await cut.close()
    return whole, runs, full.retries + cut.retries
