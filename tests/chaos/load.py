"""Steady conversational load for the fault campaign, and what each request saw.

Each worker holds one session and sends its turns one after the other, every request
with an id of its own; a request is *acknowledged* when its last response (the finish)
arrived, which is when the router has stored the turn.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc

from llmmesh.client import authorized_channel, build_request
from llmmesh.v1 import generation_pb2_grpc


@dataclass
class Outcome:
    session: str
    request_id: str
    started_at: float
    first_token_at: float | None = None
    ended_at: float = 0.0
    code: str = "OK"  # the gRPC status it ended with
    detail: str = ""

    @property
    def acknowledged(self) -> bool:
        return self.code == "OK"

    @property
    def cut(self) -> bool:
        """It failed after text had been streamed."""
        return not self.acknowledged and self.first_token_at is not None


@dataclass
class Load:
    router: str
    api_key: str
    workers: int = 4
    max_tokens: int = 24
    turns_per_session: int = 0  # after this many turns a worker starts a new session; 0: never
    timeout_s: float = 60.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        for n in range(self.workers):
            session = f"chaos-{uuid.uuid4().hex[:8]}-{n}"
            thread = threading.Thread(target=self._converse, args=(session,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s + 5)

    def _converse(self, first: str) -> None:
        turn, session = 0, first
        while not self._stop.is_set():
            turn += 1
            if self.turns_per_session and turn % self.turns_per_session == 0:
                session = f"{first}.{turn}"  # a new conversation
            outcome = self.ask(session, f"turn {turn}: tell me more")
            with self._lock:
                self.outcomes.append(outcome)
            if not outcome.acknowledged:
                self._stop.wait(0.05)  # a failed client backs off a little, as clients do

    def ask(self, session: str, prompt: str) -> Outcome:
        """One turn of ``session``, as this load sends it."""
        outcome = Outcome(session, uuid.uuid4().hex, time.monotonic())
        request = build_request(
            prompt, max_tokens=self.max_tokens, ignore_eos=True, session_id=session
        )
        try:
            with authorized_channel(self.router, self.api_key) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                metadata = (("x-request-id", outcome.request_id),)
                for reply in stub.Generate(request, metadata=metadata, timeout=self.timeout_s):
                    if reply.text and outcome.first_token_at is None:
                        outcome.first_token_at = time.monotonic()
        except grpc.RpcError as err:
            outcome.code, outcome.detail = err.code().name, err.details() or ""
        outcome.ended_at = time.monotonic()
        return outcome

    def after(self, moment: float) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.ended_at >= moment]
