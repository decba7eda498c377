"""The count of first tokens' work that relays hold later tokens back for."""

from __future__ import annotations

import asyncio

from llmmesh import first_tokens


def test_what_waits_for_no_pending_work_runs_once_in_the_turn_after_the_last_release() -> None:
    async def scenario() -> list[str]:
        steps: list[str] = []
        work = first_tokens.work()
        first, second = work.begin(), work.begin()
        work.when_none(lambda: steps.append("held work"))
        first()
        first()  # a release is idempotent: the second piece still pends
        assert work.pending == 1
        second()
        steps.append("the releasing step")
        await _one_turn()
        second()
        assert work.pending == 0
        return steps

    assert asyncio.run(scenario()) == ["the releasing step", "held work"]


def test_a_request_pends_until_its_start_is_sent_and_not_while_it_queues() -> None:
    async def scenario() -> list[int]:
        work = first_tokens.work()
        seen = [work.pending]
        with first_tokens.request_pending():
            seen.append(work.pending)
            with first_tokens.waiting():
                seen.append(work.pending)
            seen.append(work.pending)
            first_tokens.start_sent()
            seen.append(work.pending)
            first_tokens.start_sent()  # a retry's start: already counted out
            seen.append(work.pending)
        seen.append(work.pending)
        first_tokens.start_sent()  # outside a request: nothing
        seen.append(work.pending)
        return seen

    assert asyncio.run(scenario()) == [0, 1, 0, 1, 0, 0, 0, 0]


def test_a_request_that_ends_before_its_start_is_sent_counts_out() -> None:
    async def scenario() -> int:
        work = first_tokens.work()
        try:
            with first_tokens.request_pending():
                raise ValueError("refused by policy")
        except ValueError:
            pass
        return work.pending

    assert asyncio.run(scenario()) == 0


def test_each_loop_counts_its_own() -> None:
    async def pend() -> int:
        first_tokens.work().begin()
        return first_tokens.work().pending

    assert asyncio.run(pend()) == 1
    assert asyncio.run(pend()) == 1


def test_a_requests_task_pends_from_its_creation_until_its_start_is_sent() -> None:
    async def scenario() -> list[int]:
        work = first_tokens.work()
        seen: list[int] = []
        sent, relayed = asyncio.Event(), asyncio.Event()

        async def request() -> None:
            seen.append(work.pending)
            with first_tokens.request_pending():  # takes over the task's count
                seen.append(work.pending)
                first_tokens.start_sent()
                sent.set()
                await relayed.wait()  # its generation streams on

        task = first_tokens.pending_task(request())
        seen.append(work.pending)  # counted before the task's first step
        await asyncio.wait_for(sent.wait(), 5)
        seen.append(work.pending)
        relayed.set()
        await task
        seen.append(work.pending)
        return seen

    assert asyncio.run(scenario()) == [1, 1, 1, 0, 0]


def test_a_requests_task_that_ends_without_a_start_counts_out() -> None:
    async def scenario() -> int:
        async def refused() -> None:
            raise ValueError("malformed")

        task = first_tokens.pending_task(refused())
        await asyncio.gather(task, return_exceptions=True)
        return first_tokens.work().pending

    assert asyncio.run(scenario()) == 0


async def _one_turn() -> None:
    done = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(done.set_result, None)
    await done
