"""A response of OpenAI's Responses API: the object (``GET /v1/responses/{id}``, a whole
reply) and the server-sent events that build it as it streams, in the order the
``openai`` SDK parses them. Its output is items: the answer's message, or with tools the
calls of functions (read from the model's tool JSON as chat completions read it)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmmesh.runtime.errors import MeshError
from llmmesh.types import Chunk, FinishReason, TokenLogprob
from services.router.obfuscation import padded
from services.router.openai_reply import chat_logprobs
from services.router.tool_calls import CALLS, call_id
from services.router.tool_stream import Delta, ToolStream

# Why a response ended before its answer did (its status is then "incomplete").
INCOMPLETE = {
    FinishReason.LENGTH: "max_output_tokens",
    FinishReason.BUDGET: "max_output_tokens",
    FinishReason.POLICY: "content_filter",
}
RECORD_KEY = "response"  # the session metadata entry that makes a session a response
METADATA_PREFIX = "metadata."  # the client's metadata, one session metadata entry each
# The context service keeps at most 64 metadata entries of 4096 characters: a record too
# long for one entry goes on in "response.1", "response.2", ... beside the client's 16.
ENTRY_CHARS = 4096
MAX_RECORD_CHARS = ENTRY_CHARS * (64 - 16)


def call_item_id(call: str) -> str:
    """A function call item's id, from its call's (``call_...`` -> ``fc_...``)."""
    return "fc_" + call.removeprefix("call_")


@dataclass
class OutputItem:
    """One item of the output: the answer's message (``call_id`` empty) or a function
    call; ``text`` is the message's text or the call's arguments as written so far."""

    id: str
    call_id: str = ""
    name: str = ""
    text: str = ""
    state: str = "new"  # new, open (its opening events sent), done (its closing ones too)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # a message's, if asked

    def object(self, status: str) -> dict[str, Any]:
        if self.call_id:
            return {
                "id": self.id,
                "type": "function_call",
                "status": status,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": self.text,
            }
        return {
            "id": self.id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [] if status == "in_progress" else [self.part()],
        }

    def part(self) -> dict[str, Any]:
        return {
            "type": "output_text",
            "text": self.text,
            "annotations": [],
            "logprobs": self.logprobs,
        }


@dataclass
class ResponseDraft:
    """The response as it is written: its settings (echoed as the client gave them), its
    output items so far and, once it ends, its status and usage. ``tools``: the decoder of
    the model's tool JSON, when the request has tools (the output's items are then what
    the answer turns out to be; without tools, one message from the start)."""

    id: str
    model: str
    created_at: int
    settings: dict[str, Any]  # previous_response_id, max_output_tokens, store, tools, ...
    instructions: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    tools: ToolStream | None = None
    items: list[OutputItem] = field(default_factory=list)
    input: list[list[str]] = field(default_factory=list)  # each input item's type and detail
    streaming: bool = False  # False: no events are written (a whole reply, a stored one)
    obfuscated: bool = False  # delta events padded (services/router/obfuscation.py)
    status: str = "in_progress"
    incomplete_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    _sequence: int = 0

    def __post_init__(self) -> None:
        if self.tools is None and not self.items:
            self.items.append(OutputItem(self.message_id))

    @property
    def message_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")

    @property
    def text(self) -> str:
        """The answer's text (``output_text``): its message's, if it has one."""
        return "".join(item.text for item in self.items if not item.call_id)

    def add(self, chunk: Chunk) -> list[bytes]:
        """The chunk taken into the output; the events that stream it."""
        ended = chunk.finish_reason is not None
        deltas = self._deltas(chunk.text, ended, chunk.logprobs)
        events = [event for delta in deltas for event in self._apply(delta)]
        if chunk.finish_reason is not None:
            self.incomplete_reason = INCOMPLETE.get(chunk.finish_reason)
            self.status = "incomplete" if self.incomplete_reason else "completed"
        return events

    def _deltas(self, text: str, ended: bool, logprobs: Sequence[TokenLogprob] = ()) -> list[Delta]:
        """The answer's text as chat completions' deltas (content, or calls with tools;
        log probabilities are asked only without tools)."""
        if self.tools is None:
            if not logprobs:
                return [{"content": text}] if text else []
            return [{"content": text, "logprobs": chat_logprobs(logprobs)["content"]}]
        deltas = self.tools.feed(text)
        return deltas + self.tools.end()[0] if ended else deltas

    def _apply(self, delta: Delta) -> Iterator[bytes]:
        if "content" in delta:
            message = next((item for item in self.items if not item.call_id), None)
            if message is None:
                yield from self._close_open()
                message = OutputItem(self.message_id)
                self.items.append(message)
            if message.state == "new":
                yield from self._open(message)
            message.text += delta["content"]
            message.logprobs += delta.get("logprobs", [])
            yield self._event(
                "response.output_text.delta",
                **self._at(message),
                delta=delta["content"],
                logprobs=delta.get("logprobs", []),
            )
        for call in delta.get(CALLS, []):
            if "id" in call:  # a new call: its name is whole
                yield from self._close_open()
                name = call["function"]["name"]
                item = OutputItem(call_item_id(call["id"]), call["id"], name)
                self.items.append(item)
                yield from self._open(item)
            written = call["function"]["arguments"]
            if written:
                item = self.items[-1]
                item.text += written
                index = self.items.index(item)
                yield self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=index,
                    delta=written,
                )

    def finish(self, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> None:
        self.usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens,
        }

    def fail(self, err: MeshError) -> None:
        self.status = "failed"
        self.error = {"code": "server_error", "message": err.message}

    # The object.

    def _item_status(self) -> str:
        if self.status == "in_progress":
            return "in_progress"
        return "incomplete" if self.status == "incomplete" else "completed"

    def object(self) -> dict[str, Any]:
        done = self.status != "in_progress"
        reason = self.incomplete_reason
        output = [item.object(self._item_status()) for item in self.items]
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "model": self.model,
            "output": output if done and self.status != "failed" else [],
            "output_text": self.text if done else "",
            "instructions": self.instructions,
            "metadata": self.metadata,
            "error": self.error,
            "incomplete_details": {"reason": reason} if reason else None,
            "usage": self.usage,
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "text": {"format": {"type": "text"}},
            **self.settings,
        }

    # As a record in the session store, and back.

    def record(self) -> dict[str, str]:
        """Session metadata holding the response (its answer is the session's last turn,
        its instructions the session's system prompt)."""
        kept = {
            "model": self.model,
            "created_at": self.created_at,
            "settings": self.settings,
            "status": self.status,
            "incomplete_reason": self.incomplete_reason,
            "usage": self.usage,
            "error": self.error,
            "calls": [item.call_id for item in self.items if item.call_id],
            "input": self.input,
        }
        raw = json.dumps(kept, separators=(",", ":"))
        entries = {
            _entry_key(n): raw[at : at + ENTRY_CHARS]
            for n, at in enumerate(range(0, len(raw), ENTRY_CHARS))
        }
        entries.update({METADATA_PREFIX + k: v for k, v in self.metadata.items()})
        return entries

    @classmethod
    def from_record(
        cls, response_id: str, metadata: dict[str, str], instructions: str, text: str
    ) -> ResponseDraft | None:
        if RECORD_KEY not in metadata:
            return None  # a session, not a response
        parts, n = [], 0
        while _entry_key(n) in metadata:
            parts.append(metadata[_entry_key(n)])
            n += 1
        kept = json.loads("".join(parts))
        user = {
            k.removeprefix(METADATA_PREFIX): v
            for k, v in metadata.items()
            if k.startswith(METADATA_PREFIX)
        }
        ids = iter(kept.get("calls", []))
        tools = ToolStream(lambda: next(ids, None) or call_id())
        settings = kept["settings"]
        draft = cls(
            response_id,
            kept["model"],
            kept["created_at"],
            settings,
            instructions or None,
            user,
            tools if settings.get("tools") else None,
        )
        draft.status = kept["status"]
        draft.incomplete_reason = kept["incomplete_reason"]
        draft.usage = kept["usage"]
        draft.error = kept["error"]
        draft.input = kept.get("input", [])
        draft.replay(text)
        return draft

    def replay(self, text: str) -> None:
        """The output read again from the answer's whole text (its events unsent)."""
        for delta in self._deltas(text, True):
            for _ in self._apply(delta):
                pass

    # As server-sent events.

    def _event(self, kind: str, **fields: Any) -> bytes:
        if not self.streaming:
            return b""
        doc = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        data = json.dumps(doc, separators=(",", ":"))
        if self.obfuscated and kind.endswith(".delta"):
            data = padded(data)
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def _at(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.items.index(item), "content_index": 0}

    def _open(self, item: OutputItem) -> Iterator[bytes]:
        item.state = "open"
        index = self.items.index(item)
        yield self._event(
            "response.output_item.added", output_index=index, item=item.object("in_progress")
        )
        if not item.call_id:
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield self._event("response.content_part.added", **self._at(item), part=part)

    def _close_open(self) -> Iterator[bytes]:
        for item in self.items:
            if item.state == "open":
                yield from self._close(item)

    def _close(self, item: OutputItem) -> Iterator[bytes]:
        item.state = "done"
        index = self.items.index(item)
        if item.call_id:
            yield self._event(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                arguments=item.text,
            )
        else:
            at = self._at(item)
            written = {"text": item.text, "logprobs": item.logprobs}
            yield self._event("response.output_text.done", **at, **written)
            yield self._event("response.content_part.done", **at, part=item.part())
        done = item.object(self._item_status())
        yield self._event("response.output_item.done", output_index=index, item=done)

    def opening(self) -> Iterator[bytes]:
        yield self._event("response.created", response=self.object())
        yield self._event("response.in_progress", response=self.object())
        for item in self.items:  # without tools, the message from the start
            yield from self._open(item)

    def closing(self) -> Iterator[bytes]:
        yield from self._close_open()
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        yield self._event(kind, response=self.object())

    def failure(self, code: str, message: str) -> Iterator[bytes]:
        yield self._event("error", code=code, message=message, param=None)
        yield self._event("response.failed", response=self.object())


def _entry_key(n: int) -> str:
    return RECORD_KEY if n == 0 else f"{RECORD_KEY}.{n}"
