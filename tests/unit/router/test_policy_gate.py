"""The policy gate's audit batches survive a policy restart, and its followed rules
outlive a broken watch for as long as they are fresh."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from llmmesh.runtime.errors import Unavailable
from llmmesh.types import PolicyAction
from llmmesh.waiting import poll_until_async
from services.router.policy_gate import MAX_RECORDS_PER_CALL, AuditRecord, DecisionRecorder


async def _nothing() -> None:
    return None


def record(n: int) -> AuditRecord:
    return AuditRecord(f"r{n}", "t", "input", "v1", PolicyAction.ALLOW, (), "")


def test_decisions_policy_does_not_take_are_sent_again_in_order() -> None:
    async def scenario() -> None:
        taken: list[str] = []
        refusals = [2]  # policy is down for the first two calls

        async def send(batch: Sequence[AuditRecord]) -> None:
            if refusals[0]:
                refusals[0] -= 1
                raise Unavailable("policy service is unavailable")
            taken.extend(r.request_id for r in batch)

        recorder = DecisionRecorder(send)
        for n in range(3):
            recorder.add(record(n))

        async def all_taken() -> bool:
            return len(taken) == 3

        assert await poll_until_async(all_taken, 5)
        recorder.add(record(3))
        await recorder.close()
        assert taken == ["r0", "r1", "r2", "r3"]

    asyncio.run(scenario())


def test_decisions_close_together_share_one_call() -> None:
    """A decision waits for the next ones (a call costs far more than a record), and
    closing sends what waits at once, however long the wait was to be."""

    async def scenario() -> None:
        batches: list[list[str]] = []

        async def send(batch: Sequence[AuditRecord]) -> None:
            batches.append([r.request_id for r in batch])

        recorder = DecisionRecorder(send, linger_s=60.0)
        recorder.add(record(0))
        # Tasks start in the order they were made: once this one has run, the recorder's
        # flush has taken its first step, in which an eager recorder would have sent r0.
        await asyncio.create_task(_nothing())
        assert batches == []
        for n in range(1, 4):
            recorder.add(record(n))
        await asyncio.wait_for(recorder.close(), 5)
        assert batches == [["r0", "r1", "r2", "r3"]]

    asyncio.run(scenario())


def test_a_calls_worth_of_decisions_goes_without_waiting() -> None:
    async def scenario() -> None:
        sent = asyncio.Event()

        async def send(batch: Sequence[AuditRecord]) -> None:
            assert len(batch) == MAX_RECORDS_PER_CALL
            sent.set()

        recorder = DecisionRecorder(send, linger_s=60.0)
        for n in range(MAX_RECORDS_PER_CALL):
            recorder.add(record(n))
        await asyncio.wait_for(sent.wait(), 5)
        await recorder.close()

    asyncio.run(scenario())


def test_closing_gives_up_on_a_policy_that_never_comes_back() -> None:
    async def scenario() -> None:
        async def send(batch: Sequence[AuditRecord]) -> None:
            raise Unavailable("policy service is unavailable")

        recorder = DecisionRecorder(send)
        recorder.add(record(0))
        await asyncio.wait_for(recorder.close(grace_s=0.1), 5)

    asyncio.run(scenario())
