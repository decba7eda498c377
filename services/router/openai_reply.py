"""A generation's reply in OpenAI's shapes: chat or text completion, whole or as server-sent
events, one choice per sample asked for (``n``), with log probabilities when asked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from llmmesh.runtime.errors import MeshError
from llmmesh.types import Chunk, FinishReason, TokenLogprob
from services.router.obfuscation import padded
from services.router.tool_calls import ToolUse, finish_of
from services.router.tool_stream import ToolStream, whole_answer

# The mesh's finish reasons in OpenAI's vocabulary.
FINISH = {
    FinishReason.LENGTH: "length",
    FinishReason.STOP: "stop",
    FinishReason.CANCELLED: "stop",
    FinishReason.POLICY: "content_filter",
    FinishReason.BUDGET: "length",
}


@dataclass
class Choice:
    """One sample's stream: its first chunk (read before any header is sent, so that an
    error before it is still a proper status) and the rest."""

    first: Chunk
    rest: AsyncIterator[Chunk]
    prompt_tokens: int = 0  # the prompt's, as the router counts them (BOS included)

    async def chunks(self) -> AsyncIterator[Chunk]:
        yield self.first
        if self.first.finish_reason is None:
            async for chunk in self.rest:
                yield chunk
                if chunk.finish_reason is not None:
                    return


@dataclass
class _Sample:
    parts: list[str] = field(default_factory=list)
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    offset: int = 0  # characters streamed so far
    tools: ToolStream | None = None  # the answer's decoder, with tools
    ids: list[int] = field(default_factory=list)  # its tokens', with return_token_ids
    prompt_ids: tuple[int, ...] = ()  # its prompt's, with return_token_ids


def _named(token: int, text: str, as_ids: bool) -> str:
    """A token as a log probability names it: its text, or with vLLM's
    ``return_tokens_as_token_ids`` its id (``token_id:-1`` for what a redaction replaced)."""
    return f"token_id:{token}" if as_ids else text


def _token(token: int, text: str, logprob: float, as_ids: bool) -> dict[str, Any]:
    return {
        "token": _named(token, text, as_ids),
        "logprob": logprob,
        "bytes": list(text.encode("utf-8")),
    }


def chat_logprobs(tokens: Sequence[TokenLogprob], as_ids: bool = False) -> dict[str, Any]:
    """Chat completions' ``logprobs``: per token, its text (or id), bytes and log
    probability, and the likeliest tokens at its position."""
    content = [
        {
            **_token(t.token, t.text, t.logprob, as_ids),
            "top_logprobs": [_token(*top, as_ids) for top in t.top],
        }
        for t in tokens
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokens: Sequence[TokenLogprob], offset: int, as_ids: bool = False
) -> dict[str, Any]:
    """Completions' ``logprobs``: parallel lists, each token's offset in the text counted
    from ``offset`` (by its text, also where it is named by its id)."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return {
        "tokens": [_named(t.token, t.text, as_ids) for t in tokens],
        # An echoed prompt's first token has none (nothing precedes it: rank 0).
        "token_logprobs": [t.logprob if t.rank else None for t in tokens],
        "top_logprobs": [
            {_named(i, text, as_ids): logprob for i, text, logprob in t.top} if t.rank else None
            for t in tokens
        ],
        "text_offset": offsets,
    }


def echoed(first: Chunk, prompt: str, top: int | None) -> Chunk:
    """A choice's first chunk after its prompt (OpenAI's ``echo``): the prompt's text and,
    with ``logprobs: top``, its tokens' log probabilities (``top`` likeliest each) before
    the chunk's own."""
    if top is None:
        return replace(first, text=prompt + first.text)
    scored = tuple(replace(t, top=t.top[:top]) for t in first.prompt_logprobs)
    return replace(first, text=prompt + first.text, logprobs=scored + first.logprobs)


async def prompt_alone(first: Chunk, rest: AsyncIterator[Chunk]) -> Chunk:
    """The whole of a choice that asked for its prompt alone (``max_tokens: 0``): the
    engine's one token read to its end and dropped, what the first chunk says of the
    prompt kept, finished as OpenAI's are (``length``)."""
    last = first
    while last.finish_reason is None:
        last = await anext(rest)
    return Chunk(
        "",
        finish_reason=FinishReason.LENGTH,
        cached_tokens=first.cached_tokens,
        prompt_logprobs=first.prompt_logprobs,
        prompt_token_ids=first.prompt_token_ids,
    )


def vllm_prompt_logprobs(choice: Choice, top: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, null for one nothing precedes (a BOS
    the engine adds, which it does not score, or a first token), else {token id:
    {logprob, rank, decoded_token}} for the token and the ``top`` likeliest."""
    scored = choice.first.prompt_logprobs
    unscored: list[dict[str, Any] | None] = [None] * max(0, choice.prompt_tokens - len(scored))
    return unscored + [_vllm_entry(t, top) if t.rank else None for t in scored]


def _vllm_entry(token: TokenLogprob, top: int) -> dict[str, Any]:
    entry = {str(token.token): _vllm_logprob(token.logprob, token.rank, token.text)}
    for rank, (i, text, logprob) in enumerate(token.top[:top], start=1):
        entry.setdefault(str(i), _vllm_logprob(logprob, rank, text))
    return entry


def _vllm_logprob(logprob: float, rank: int, text: str) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": text}


def sse(doc: dict[str, Any] | str, obfuscated: bool = False) -> bytes:
    """A server-sent event; ``obfuscated``: an object's padded (services/router/obfuscation.py)."""
    if isinstance(doc, str):
        return f"data: {doc}\n\n".encode()
    data = json.dumps(doc, separators=(",", ":"))
    return f"data: {padded(data) if obfuscated else data}\n\n".encode()


class Reply:
    """One response: ``n`` choices of one prompt."""

    def __init__(
        self,
        response_id: str,
        model: str,
        chat: bool,
        *,
        n: int,
        logprobs: bool,
        usage: bool,
        tools: ToolUse | None = None,
        prompt_logprobs: list[list[dict[str, Any] | None]] | None = None,
        tokens_as_ids: bool = False,
        token_ids: bool = False,
        obfuscated: bool = False,
    ) -> None:
        """``prompt_logprobs``: each choice's in vLLM's form, when asked (whole replies
        only: a completion's in each choice, a chat's beside them). ``tokens_as_ids``:
        vLLM's ``return_tokens_as_token_ids``, the log probabilities' tokens named by id.
        ``token_ids``: vLLM's ``return_token_ids``, each choice's ``token_ids`` and the
        prompt's ``prompt_token_ids`` (a completion's in each choice, a chat's beside
        them), streamed too: each event's tokens, the prompt's in a choice's first.
        ``obfuscated``: each streamed chunk padded (OpenAI's stream obfuscation)."""
        self.id = response_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self.include_usage = usage
        self.obfuscated = obfuscated
        self._logprobs = logprobs
        self._as_ids = tokens_as_ids
        self._token_ids = token_ids
        self._tools = tools
        self._samples = [_Sample(tools=ToolStream() if tools else None) for _ in range(n)]
        self._prompt_logprobs = prompt_logprobs
        self.completion_tokens = 0

    def add(self, index: int, chunk: Chunk) -> None:
        sample = self._samples[index]
        sample.parts.append(chunk.text)
        sample.tokens += chunk.logprobs
        sample.ids += chunk.token_ids
        if chunk.prompt_token_ids:
            sample.prompt_ids = chunk.prompt_token_ids
        self.completion_tokens += chunk.num_tokens
        if chunk.finish_reason is not None:
            sample.finish = FINISH[chunk.finish_reason]

    def _logprobs_of(self, tokens: Sequence[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if not self._logprobs:
            return None
        if self.chat:
            return chat_logprobs(tokens, self._as_ids)
        return completion_logprobs(tokens, offset, self._as_ids)

    def usage(self, prompt_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    def whole(self, usage: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for index, sample in enumerate(self._samples):
            text = "".join(sample.parts)
            choice: dict[str, Any] = {
                "index": index,
                "finish_reason": sample.finish,
                "logprobs": self._logprobs_of(sample.tokens, 0),
            }
            if self._tools:
                content, calls = whole_answer(text)
                choice["finish_reason"] = finish_of(sample.finish, calls, self._tools)
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = calls
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
                if self._prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs[index]
            choices.append(self._with_ids(choice, sample.ids, sample.prompt_ids))
        whole = "chat.completion" if self.chat else "text_completion"
        reply = {**self._envelope(choices, whole), "usage": usage}
        if self.chat and self._prompt_logprobs is not None:  # the choices share the prompt
            reply["prompt_logprobs"] = self._prompt_logprobs[0]
        if self.chat and self._token_ids:
            reply["prompt_token_ids"] = list(self._samples[0].prompt_ids)
        return reply

    def _with_ids(
        self, choice: dict[str, Any], ids: Sequence[int], prompt_ids: Sequence[int]
    ) -> dict[str, Any]:
        """The choice with its tokens' ids and (a completion's) its prompt's, when asked."""
        if self._token_ids:
            choice["token_ids"] = list(ids)
            if not self.chat:
                choice["prompt_token_ids"] = list(prompt_ids) or None
        return choice

    def _tool_events(self, index: int, chunk: Chunk, first: bool) -> list[dict[str, Any]]:
        """A chunk's events with tools: the answer's deltas as the decoder lets them out,
        the finish reason on the last."""
        tools, sample = self._tools, self._samples[index]
        assert tools is not None and sample.tools is not None
        deltas = sample.tools.feed(chunk.text)
        finish: str | None = None
        calls: list[dict[str, Any]] = []
        if chunk.finish_reason is not None:
            last, calls = sample.tools.end()
            deltas += last
            finish = FINISH[chunk.finish_reason]
        if first:
            deltas = [{"role": "assistant", "content": None}, *deltas]
        if finish is not None and not deltas:
            deltas = [{}]
        choices: list[dict[str, Any]] = [
            {"index": index, "finish_reason": None, "logprobs": None, "delta": d} for d in deltas
        ]
        if choices and finish is not None:
            choices[-1]["finish_reason"] = finish_of(finish, calls, tools)
        return [self._envelope([choice]) for choice in choices]

    def _event(self, index: int, chunk: Chunk, first: bool) -> dict[str, Any]:
        sample = self._samples[index]
        finish = FINISH[chunk.finish_reason] if chunk.finish_reason is not None else None
        logprobs = self._logprobs_of(chunk.logprobs, sample.offset) if chunk.logprobs else None
        sample.offset += len(chunk.text)
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
        if self.chat:
            delta: dict[str, Any] = {"content": chunk.text}
            if first:
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            choice["text"] = chunk.text
        event = self._envelope([self._with_ids(choice, chunk.token_ids, chunk.prompt_token_ids)])
        if self.chat and self._token_ids and first:
            event["prompt_token_ids"] = list(chunk.prompt_token_ids)
        return event

    def _envelope(self, choices: list[dict[str, Any]], kind: str = "") -> dict[str, Any]:
        """The fields every reply has; ``kind``: its object type (default: a chunk's)."""
        return {
            "id": self.id,
            "object": kind or ("chat.completion.chunk" if self.chat else "text_completion"),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    async def events(
        self, choices: list[Choice], prompt_tokens: int, cached_tokens: int = 0
    ) -> AsyncGenerator[bytes, None]:
        """Every choice's chunks as they come (interleaved, each with its index), then the
        usage if asked, then ``[DONE]``."""
        async with contextlib.aclosing(merged(choices)) as chunks:
            started = [False] * len(choices)
            async for index, chunk in chunks:
                self.add(index, chunk)
                if self._tools:
                    for event in self._tool_events(index, chunk, not started[index]):
                        yield sse(event, self.obfuscated)
                    started[index] = True
                elif (
                    chunk.text
                    or chunk.finish_reason
                    or chunk.logprobs
                    or chunk.token_ids
                    or not started[index]
                ):
                    yield sse(self._event(index, chunk, not started[index]), self.obfuscated)
                    started[index] = True
        if self.include_usage:
            usage = self.usage(prompt_tokens, cached_tokens)
            yield sse({**self._envelope([]), "usage": usage}, self.obfuscated)
        yield sse("[DONE]")


_DONE = object()


async def merged(choices: list[Choice]) -> AsyncGenerator[tuple[int, Chunk], None]:
    """(index, chunk) of every choice as each arrives; a choice's error ends them all."""
    if len(choices) == 1:  # the common case, without tasks
        async for chunk in choices[0].chunks():
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, Chunk | MeshError] | object] = asyncio.Queue()

    async def pump(index: int, choice: Choice) -> None:
        try:
            async for chunk in choice.chunks():
                queue.put_nowait((index, chunk))
        except MeshError as err:
            queue.put_nowait((index, err))
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
                continue
            assert isinstance(item, tuple)
            index, payload = item
            if isinstance(payload, MeshError):
                raise payload
            yield index, payload
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
