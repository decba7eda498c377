"""The routing scenario's sessions as each kind of target receives them."""

from __future__ import annotations

import asyncio

from bench.metrics import RequestRecord
from bench.routing import Placement, SessionSpec, make_sessions, placement_of, run_sessions
from bench.workload import BenchRequest


class Recording:
    name = "recording"

    def __init__(self) -> None:
        self.sent: list[BenchRequest] = []

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        self.sent.append(request)
        record.first_token_at = record.finished_at = record.sent_at

    async def close(self) -> None:
        return None


def _send(stateless: bool) -> tuple[list[list[BenchRequest]], list[BenchRequest]]:
    sessions = make_sessions(SessionSpec(sessions=1, turns=3), "[s] ")
    target = Recording()
    asyncio.run(run_sessions(target, sessions, rate=1000.0, seed=0, stateless=stateless))
    return sessions, target.sent


def test_a_router_keeping_sessions_gets_each_turn_with_its_session() -> None:
    sessions, sent = _send(stateless=False)
    assert sent == sessions[0]
    assert all(turn.session_id for turn in sent)


def test_a_client_keeping_the_history_resends_the_earlier_prompts_without_a_session() -> None:
    sessions, sent = _send(stateless=True)
    turns = sessions[0]
    assert [r.prompt for r in sent] == [
        turns[0].prompt,
        turns[0].prompt + turns[1].prompt,
        turns[0].prompt + turns[1].prompt + turns[2].prompt,
    ]
    assert not any(r.session_id for r in sent)
    assert [r.max_tokens for r in sent] == [t.max_tokens for t in turns]


METRICS = """\
# TYPE llm_engine_requests_finished_total counter
llm_engine_requests_finished_total{model="llm_r0",reason="length"} 6
llm_engine_requests_finished_total{model="llm_r0",reason="stop"} 2
llm_engine_requests_finished_total{model="llm_r2",reason="length"} 4
llm_engine_requests_finished_total{model="llm",reason="length"} 99
# TYPE llm_engine_prompt_tokens_total counter
llm_engine_prompt_tokens_total{model="llm_r0"} 1000
llm_engine_prompt_tokens_total{model="llm_r2"} 600
llm_engine_prompt_tokens_total{model="llm"} 5000
# TYPE llm_engine_prefix_cache_hit_tokens_total counter
llm_engine_prefix_cache_hit_tokens_total{model="llm_r0"} 700
llm_engine_prefix_cache_hit_tokens_total{model="llm_r2"} 100
"""


def test_placement_counts_each_replica_and_the_cached_share_of_the_fleet() -> None:
    now = placement_of(METRICS)
    assert now == Placement((8.0, 0.0, 4.0, 0.0), 1600.0, 800.0)  # the stack's "llm" left out
    before = Placement((2.0, 0.0, 4.0, 0.0), 600.0, 100.0)
    run = now.minus(before)
    assert run == Placement((6.0, 0.0, 0.0, 0.0), 1000.0, 700.0)
    assert run.plus(run).cells() == "12 / 0 / 0 / 0 | 70%"
