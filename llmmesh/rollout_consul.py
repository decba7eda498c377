"""Rollouts kept in Consul: the status document in KV, one controller at a time by a
Consul session lock, and the always-on controller that runs the rollout document an
operator writes to ``llm-mesh/rollout``.

The lock is Consul's documented leader-election recipe: a session with a TTL (renewed
well within it) acquires ``llm-mesh/rollout/lock``; a controller that dies stops renewing,
Consul invalidates its session after the TTL and releases the lock, and a standby
controller blocked on the lock key takes it. A controller that finds it lost its session
stops before its next write (``Rollout.holds_lock``). The status document carries the
rollout document's ``ModifyIndex``, so a successor resumes an unfinished rollout at its
step and never runs a finished one again.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import consul

from llmmesh.canary import CanaryError, ConsulRouting
from llmmesh.rollout import Observations, Outcome, Rollout, RolloutDocument
from llmmesh.rollout_status import ConsulStatus

log = logging.getLogger(__name__)

DOCUMENT_KEY = "llm-mesh/rollout"
LOCK_KEY = "llm-mesh/rollout/lock"
SESSION_TTL_S = 15  # Consul takes 10 s to 24 h; it may wait up to twice this to expire
STANDBY_CHECK_S = 5.0  # a standby looks at its stop flag this often
FINAL_STATES = {o.value for o in Outcome} | {"done", "invalid"}


class ConsulLock:
    """``LOCK_KEY`` held by a session of this process, renewed in the background."""

    def __init__(
        self, client: consul.Consul, ttl_s: int = SESSION_TTL_S, renew_every_s: float = 0.0
    ) -> None:
        self._client = client
        self._ttl = ttl_s
        self._renew_every = renew_every_s or ttl_s / 3
        self._session = ""
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.holder = f"{socket.gethostname()}:{threading.get_native_id()}"

    def held(self) -> bool:
        return bool(self._session) and not self._lost.is_set()

    def acquire(self, wait_s: float = 0.0) -> None:
        """Takes the lock, waiting up to ``wait_s`` for its holder to let go (blocking
        queries on the key); CanaryError naming the holder if it cannot."""
        self._session = self._client.session.create(
            name="llm-mesh rollout controller", ttl=self._ttl, lock_delay=0, behavior="release"
        )
        self._lost.clear()
        deadline, index = time.monotonic() + wait_s, None
        while not self._client.kv.put(LOCK_KEY, self.holder, acquire=self._session):
            left = deadline - time.monotonic()
            if left <= 0:
                holder = self._holder()
                self._client.session.destroy(self._session)
                self._session = ""
                raise CanaryError(f"another rollout holds consul kv {LOCK_KEY} ({holder})")
            wait = f"{max(1, min(int(left), int(self._renew_every)))}s"
            index, _ = self._client.kv.get(LOCK_KEY, index=index, wait=wait)
            self._client.session.renew(self._session)  # ours lives while it waits
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, daemon=True)
        self._renewer.start()

    def _holder(self) -> str:
        _, entry = self._client.kv.get(LOCK_KEY)
        return ((entry or {}).get("Value") or b"").decode("utf-8", "replace")

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self._session:
            with contextlib.suppress(consul.ConsulException, OSError):
                self._client.kv.put(LOCK_KEY, self.holder, release=self._session)
                self._client.session.destroy(self._session)
        self._session = ""

    def _renew(self) -> None:
        while not self._stop.wait(self._renew_every):  # the renewal period
            try:
                self._client.session.renew(self._session)
            except (consul.ConsulException, OSError) as err:
                log.warning("rollout lock lost", extra={"fields": {"error": repr(err)}})
                self._lost.set()
                return

    def __enter__(self) -> ConsulLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class Controller:
    """The always-on controller: holds the lock (a standby waits for it), follows the
    rollout document and runs each new one to its end."""

    client: consul.Consul
    observe: Callable[[RolloutDocument], Observations]
    lock: ConsulLock
    sleep: Callable[[float], None]
    stop: threading.Event
    wait_s: float = STANDBY_CHECK_S  # longest blocking query: how soon a stop is seen

    def serve(self) -> None:
        while not self.stop.is_set():
            try:
                self.lock.acquire(wait_s=self.wait_s)
            except CanaryError:
                continue  # a standby: another controller holds the lock
            log.info("rollout controller holds the lock", extra={"fields": {"key": LOCK_KEY}})
            with self.lock:
                try:
                    self._follow()
                except CanaryError as err:  # lost the lock, or Consul refused a write
                    log.warning("rollout controller stopped", extra={"fields": {"error": str(err)}})

    def _follow(self) -> None:
        index: int | None = None
        while not self.stop.is_set() and self.lock.held():
            index, entry = self.client.kv.get(DOCUMENT_KEY, index=index, wait=f"{self.wait_s:g}s")
            if entry is not None:
                self.run_document(int(entry["ModifyIndex"]), entry.get("Value") or b"")

    def run_document(self, document_index: int, text: bytes) -> Outcome | None:
        """Runs the document unless its rollout already ended; resumes one that a
        previous controller left midway at its step."""
        status = ConsulStatus(self.client, document_index)
        before = status.read() or {}
        if before.get("document_index") == document_index:
            if before.get("state") in FINAL_STATES:
                return None
            first_step = int(before.get("step", 1)) - 1
        else:
            first_step = 0
        try:
            document = RolloutDocument.parse(text, f"consul kv {DOCUMENT_KEY}")
        except CanaryError as err:
            status.write({"state": "invalid", "why": str(err), "step": 0, "weight": 0})
            return None
        rollout = Rollout(
            document.settings(),
            ConsulRouting(self.client),
            self.observe(document),
            status,
            sleep=self.sleep,
            holds_lock=self.lock.held,
        )
        log.info("rollout", extra={"fields": {"document_index": document_index}})
        return rollout.run(first_step)


@contextlib.contextmanager
def consul_lock(client: consul.Consul) -> Iterator[ConsulLock]:
    """The lock for a one-off rollout (``canary rollout --consul``): now, or CanaryError."""
    lock = ConsulLock(client)
    lock.acquire()
    with lock:
        yield lock
