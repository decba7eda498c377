"""A response of OpenAI's Responses API: the object (``GET /v1/responses/{id}``, a whole
reply) and the server-sent events that build it as it streams, in the order the
``openai`` SDK parses them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from llmmesh.runtime.errors import MeshError
from llmmesh.types import Chunk, FinishReason

# Why a response ended before its answer did (its status is then "incomplete").
INCOMPLETE = {
    FinishReason.LENGTH: "max_output_tokens",
    FinishReason.BUDGET: "max_output_tokens",
    FinishReason.POLICY: "content_filter",
}
RECORD_KEY = "response"  # the session metadata entry that makes a session a response
METADATA_PREFIX = "metadata."  # the client's metadata, one session metadata entry each


@dataclass
class ResponseDraft:
    """The response as it is written: its settings (echoed as the client gave them), the
    answer so far and, once it ends, its status and usage."""

    id: str
    model: str
    created_at: int
    settings: dict[str, Any]  # previous_response_id, max_output_tokens, store, truncation, ...
    instructions: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    parts: list[str] = field(default_factory=list)
    status: str = "in_progress"
    incomplete_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    _sequence: int = 0

    @property
    def message_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, chunk: Chunk) -> None:
        self.parts.append(chunk.text)
        if chunk.finish_reason is not None:
            self.incomplete_reason = INCOMPLETE.get(chunk.finish_reason)
            self.status = "incomplete" if self.incomplete_reason else "completed"

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

    def _part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def _message(self, done: bool) -> dict[str, Any]:
        status = "in_progress"
        if done:
            status = "incomplete" if self.status == "incomplete" else "completed"
        return {
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [self._part()] if done else [],
        }

    def object(self) -> dict[str, Any]:
        done = self.status != "in_progress"
        reason = self.incomplete_reason
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "model": self.model,
            "output": [self._message(True)] if done and self.status != "failed" else [],
            "output_text": self.text if done else "",
            "instructions": self.instructions,
            "metadata": self.metadata,
            "error": self.error,
            "incomplete_details": {"reason": reason} if reason else None,
            "usage": self.usage,
            "tools": [],
            "tool_choice": "none",
            "parallel_tool_calls": False,
            "text": {"format": {"type": "text"}},
            **self.settings,
        }

    # As a record in the session store, and back.

    def record(self) -> dict[str, str]:
        """Session metadata holding the response (its text is the session's last turn,
        its instructions the session's system prompt)."""
        kept = {
            "model": self.model,
            "created_at": self.created_at,
            "settings": self.settings,
            "status": self.status,
            "incomplete_reason": self.incomplete_reason,
            "usage": self.usage,
            "error": self.error,
        }
        entries = {RECORD_KEY: json.dumps(kept, separators=(",", ":"))}
        entries.update({METADATA_PREFIX + k: v for k, v in self.metadata.items()})
        return entries

    @classmethod
    def from_record(
        cls, response_id: str, metadata: dict[str, str], instructions: str, text: str
    ) -> ResponseDraft | None:
        raw = metadata.get(RECORD_KEY)
        if raw is None:
            return None  # a session, not a response
        kept = json.loads(raw)
        user = {
            k.removeprefix(METADATA_PREFIX): v
            for k, v in metadata.items()
            if k.startswith(METADATA_PREFIX)
        }
        draft = cls(
            response_id,
            kept["model"],
            kept["created_at"],
            kept["settings"],
            instructions or None,
            user,
            [text],
        )
        draft.status = kept["status"]
        draft.incomplete_reason = kept["incomplete_reason"]
        draft.usage = kept["usage"]
        draft.error = kept["error"]
        return draft

    # As server-sent events.

    def _event(self, kind: str, **fields: Any) -> bytes:
        doc = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        data = json.dumps(doc, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def opening(self) -> Iterator[bytes]:
        yield self._event("response.created", response=self.object())
        yield self._event("response.in_progress", response=self.object())
        yield self._event("response.output_item.added", output_index=0, item=self._message(False))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield self._event("response.content_part.added", **self._at(), part=part)

    def delta(self, text: str) -> bytes:
        return self._event("response.output_text.delta", **self._at(), delta=text, logprobs=[])

    def closing(self) -> Iterator[bytes]:
        yield self._event("response.output_text.done", **self._at(), text=self.text, logprobs=[])
        yield self._event("response.content_part.done", **self._at(), part=self._part())
        yield self._event("response.output_item.done", output_index=0, item=self._message(True))
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        yield self._event(kind, response=self.object())

    def failure(self, code: str, message: str) -> Iterator[bytes]:
        yield self._event("error", code=code, message=message, param=None)
        yield self._event("response.failed", response=self.object())
