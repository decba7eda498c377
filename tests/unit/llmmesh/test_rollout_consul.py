"""Rollouts kept in Consul (against tests/consul_double.py): one controller at a time by
a session lock, a lost session stops its holder, a standby takes over, and the
always-on controller runs each rollout document once, resuming one left midway."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import consul
import pytest

from llmmesh.canary import CanaryError
from llmmesh.rollout import Outcome
from llmmesh.rollout_consul import DOCUMENT_KEY, ConsulLock, Controller
from llmmesh.rollout_status import ConsulStatus
from llmmesh.waiting import poll_until
from tests.consul_double import ConsulDoubleThread
from tests.unit.llmmesh.test_rollout import Observations, snapshot

DOCUMENT = {
    "model": "m", "steps": [10, 50, 100], "interval": "30s", "max_wait": 3,
    "min_samples": 5, "min_pairs": 2,
}  # fmt: skip


@pytest.fixture
def client() -> Iterator[consul.Consul]:
    with ConsulDoubleThread() as double:
        host, port = double.address.split(":")
        client = consul.Consul(host=host, port=int(port))
        client.kv.put("llm-mesh/routing", json.dumps({"split": {"stable": 100, "canary": 0}}))
        yield client


def controller(client: consul.Consul, stop: threading.Event | None = None) -> Controller:
    lock = ConsulLock(client, renew_every_s=0.05)
    return Controller(
        client, lambda _: Observations(snapshot()), lock, lambda _: None,
        stop or threading.Event(), wait_s=0.2,
    )  # fmt: skip


def split(client: consul.Consul) -> dict[str, float]:
    _, entry = client.kv.get("llm-mesh/routing")
    return dict(json.loads(entry["Value"])["split"])


def test_one_holder_at_a_time_and_a_lost_session_stops_its_holder(client: consul.Consul) -> None:
    first, second = ConsulLock(client, renew_every_s=0.05), ConsulLock(client)
    first.acquire()
    with pytest.raises(CanaryError, match="another rollout holds"):
        second.acquire()
    client.session.destroy(first._session)  # Consul invalidates it (its TTL ran out, say)
    assert poll_until(lambda: not first.held(), 5)
    second.acquire()
    assert second.held()
    second.release()
    first.release()


def test_a_standby_takes_the_lock_when_its_holder_lets_go(client: consul.Consul) -> None:
    holder, standby = ConsulLock(client), ConsulLock(client)
    holder.acquire()
    waiting = threading.Thread(target=standby.acquire, kwargs={"wait_s": 30})
    waiting.start()
    holder.release()
    waiting.join(10)
    assert standby.held()
    standby.release()


def test_each_document_runs_once_and_a_successor_resumes_at_its_step(
    client: consul.Consul,
) -> None:
    run = controller(client)
    run.lock.acquire()
    assert run.run_document(7, json.dumps(DOCUMENT).encode()) is Outcome.PROMOTED
    status = ConsulStatus(client).read()
    assert status is not None
    assert (status["state"], status["document_index"]) == ("promoted", 7)
    assert split(client) == {"canary": 100, "stable": 0}
    assert run.run_document(7, json.dumps(DOCUMENT).encode()) is None  # ran already
    # A controller died at step 2 of document 8: its successor goes on from there.
    ConsulStatus(client, 8).write({"state": "waiting", "step": 2, "weight": 50, "why": ""})
    client.kv.put("llm-mesh/routing", json.dumps({"split": {"stable": 50, "canary": 50}}))
    assert run.run_document(8, json.dumps(DOCUMENT).encode()) is Outcome.PROMOTED
    history = [(e["step"], e["state"]) for e in ConsulStatus(client).read()["history"]]  # type: ignore[index]
    assert history[0] == (2, "running")
    run.lock.release()


def test_an_invalid_document_is_recorded_naming_the_field(client: consul.Consul) -> None:
    run = controller(client)
    run.lock.acquire()
    assert run.run_document(3, json.dumps({**DOCUMENT, "max_kl": -1}).encode()) is None
    status = ConsulStatus(client).read()
    assert status is not None and status["state"] == "invalid" and "max_kl" in status["why"]
    assert split(client) == {"stable": 100, "canary": 0}
    run.lock.release()


def test_the_always_on_controller_follows_the_document_key(client: consul.Consul) -> None:
    stop = threading.Event()
    serving = threading.Thread(target=controller(client, stop).serve)
    serving.start()
    try:
        client.kv.put(DOCUMENT_KEY, json.dumps(DOCUMENT))
        _, entry = client.kv.get(DOCUMENT_KEY)

        def promoted() -> bool:
            status = ConsulStatus(client).read() or {}
            return status.get("state") == "promoted"

        assert poll_until(promoted, 10)
        assert ConsulStatus(client).read()["document_index"] == entry["ModifyIndex"]  # type: ignore[index]
    finally:
        stop.set()
        serving.join(10)
    assert not serving.is_alive()
