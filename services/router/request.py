"""What the router core passes around for one request: the request as decoded, its
generation once started, and what the transport relays."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from llmmesh.runtime import tracing
from llmmesh.types import Chunk, History, Role, Sampling, Turn
from services.router.admission import Slot
from services.router.tenants import Lease
from services.router.upstreams import OutputGuard


@dataclass(frozen=True)
class SessionUse:
    """How a request uses its session beyond reading it and adding its turn (the Responses
    API's ways; the defaults are a Generate request's)."""

    record: bool = True  # False: the session is read, never written (store: false)
    instructions: str | None = None  # this request's system prompt instead of the stored one
    tools: str = ""  # the system message that shows the model its tools (never stored)
    affinity: str = ""  # the conversation's key for replica affinity; empty: the session's

    @staticmethod
    def keyed(prompt_cache_key: str | None) -> str:
        """The affinity of a request that names a prompt cache key (OpenAI's), apart from
        any session id or conversation (empty: none named)."""
        return f"prompt_cache_key:{prompt_cache_key}" if prompt_cache_key else ""

    may_truncate: bool = True  # False: a history that does not fit is refused, never cut


MAX_CACHE_SALT = 256  # characters of a client's cache_salt (the engines get a digest)


@dataclass(frozen=True)
class GenerateInput:
    """A public Generate request as the transport decoded it."""

    request_id: str
    tenant: str
    model: str
    prompt: str
    sampling: Sampling
    session_id: str = ""
    color: str = ""  # x-llm-color: pins a traffic color / subset
    deadline: float | None = None  # time.monotonic() by which the client wants an answer
    truncation: str = ""  # how to cut a long history; empty: the tenant's choice
    cache_salt: str = ""  # the client's partition of its tenant's prefix cache (vLLM's)
    # A conversation sent whole with the request (OpenAI's messages); with a session, the
    # turns that continue it (the Responses API's input items), stored with the answer.
    inline_history: History | None = None
    inline_field: str = "messages"  # the request field the inline turns came from
    prompt_field: str = "prompt"  # the request field of the prompt, without inline turns
    session_use: SessionUse = SessionUse()
    # Each inline turn's field and then the prompt's, where an item's text is not its
    # ``content`` (a function call's arguments, its output); empty: ``field[i].content``.
    inline_names: tuple[str, ...] = ()
    # A prompt sent as token ids (``prompt`` is their text, which the checks read): the
    # engine reads them as given while the checks leave the text as it is. Empty: text.
    prompt_ids: tuple[int, ...] = ()
    # Whose the prompt is: the user's (answered after the assistant's cue), or the
    # assistant's, the start of its answer that the model goes on with (no session).
    prompt_role: Role = Role.USER

    def inline_name(self, index: int) -> str:
        """The request field of inline turn ``index`` (the prompt's after the last)."""
        if self.inline_names:
            return self.inline_names[index]
        return f"{self.inline_field}[{index}].content"


class StartedStream:
    """An inference stream, admitted and ready to start: the pick and the call happen
    when its relay asks for the first chunk, on the request's own task (a task of its
    own cost the request a loop turn before the start message went out)."""

    def __init__(self, chunks: AsyncGenerator[Chunk, None]) -> None:
        self._chunks = chunks
        # The pick and the inference call happen under this span (its context is current
        # while the first chunk is fetched); it ends with the first chunk. None when this
        # process records no spans (tracing.step).
        recording = tracing.recording()
        self._span = tracing.tracer.start_span("inference.first_token") if recording else None

    def _end_span(self) -> None:
        if self._span is not None and self._span.is_recording():
            self._span.end()

    async def chunks(self) -> AsyncIterator[Chunk]:
        if self._span is None:
            first = await anext(self._chunks)
        else:
            try:
                with tracing.using(self._span, end_on_exit=False):
                    first = await anext(self._chunks)
            finally:
                self._end_span()
        yield first
        async for chunk in self._chunks:
            yield chunk

    async def abandon(self) -> None:
        """Cancels the generation if it is still running (idempotent)."""
        self._end_span()
        await self._chunks.aclose()


@dataclass(frozen=True)
class Prepared:
    """A request that passed admission: its started generation, and what to record after."""

    request: GenerateInput
    stream: StartedStream
    user_text: str
    prompt_tokens: int
    received_at: float
    lease: Lease
    slot: Slot
    guard: OutputGuard | None = None  # the streamed output check, when the rules have one
    history: History | None = None  # the session's history as it went into the prompt
    user_tokens: int = 0  # the new message's tokens, as stored with its turn
    new_turns: tuple[Turn, ...] = ()  # inline turns that continue the session, as checked

    def release(self, first_token_at: float | None = None) -> None:
        """Gives back the tenant's stream and the admission slot (idempotent);
        ``first_token_at`` is the time.monotonic() of the first token, if any."""
        self.lease.release()
        self.slot.release(first_token_at)


@dataclass(frozen=True)
class Generation:
    """One admitted request, as its transport relays it: the chunks, and what the
    responses say besides (model, prompt tokens, the session's history)."""

    prepared: Prepared
    chunks: AsyncGenerator[Chunk, None]

    @property
    def request(self) -> GenerateInput:
        return self.prepared.request

    @property
    def prompt_tokens(self) -> int:
        return self.prepared.prompt_tokens

    @property
    def history(self) -> History | None:
        return self.prepared.history
