"""The scheduling pipeline, step by step: subset, health, region, score; plugins by name."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from llmmesh.runtime.errors import InvalidArgument, Unavailable
from services.router.affinity import PrefixIndex, prefix_hashes
from services.router.endpoints import Endpoint
from services.router.replicas import reports_alive
from services.router.routing import InvalidDocument, RoutingPolicy, ScorerWeights, parse_policy
from services.router.scheduling import (
    SCORERS,
    Candidate,
    PickContext,
    PickRequest,
    Scheduler,
    SchedulingState,
    Scorer,
    register,
)
from services.router.scheduling.filters import region_order, split_point, subset_order
from services.router.scheduling.scorers import DevicePackingParams

LOCAL = "eu"


def ReportedLoad(  # noqa: N802 (reads like the report it stands for)
    running: int = 0, waiting: int = 0, kv_utilization: float = 0.0
) -> dict[str, float]:
    """A replica's reported engine load for one model, as scheduling reads it."""
    return {"running": running, "waiting": waiting, "kv_utilization": kv_utilization}


def load_cost(c: Candidate, w: ScorerWeights) -> float:
    """What the default profile charges a candidate for its load (lower is better)."""
    policy = RoutingPolicy(weights=w)
    profile = picker().profile(policy)
    ctx = PickContext(PickRequest("llm"), picker().state, 2, 0.9)
    return -sum(
        weight * scorer.score(ctx, [c])[0]
        for scorer, weight in profile.scorers
        if scorer.reason != "affinity"
    )


def cand(
    address: str,
    version: str = "stable",
    region: str = LOCAL,
    load: dict[str, float] | None = None,
    healthy: bool = True,
    in_flight: int = 0,
    models: tuple[str, ...] = (),
    device: str = "",
) -> Candidate:
    endpoint = Endpoint(
        address=address, version=version, region=region, models=models, device=device
    )
    return Candidate(
        endpoint, region, in_flight=in_flight, load=load or ReportedLoad(), healthy=healthy
    )


def picker(seed: int = 0) -> Scheduler:
    return Scheduler(SchedulingState(LOCAL, rng=random.Random(seed)))


def test_color_pins_its_subset_and_never_leaks() -> None:
    policy = RoutingPolicy(split={"stable": 100}, colors={"blue": "canary"})
    pool = [cand("s:1"), cand("c:1", "canary")]
    p = picker()
    for _ in range(20):
        decision = p.pick(PickRequest("llm", color="blue"), pool, policy)
        assert decision.candidate.address == "c:1" and decision.reasons[0] == "color"
    # A color that names a subset directly pins it too; none healthy there: unavailable.
    assert p.pick(PickRequest("llm", color="canary"), pool, policy).subset == "canary"
    with pytest.raises(Unavailable, match="canary"):
        p.pick(
            PickRequest("llm", color="canary"),
            [pool[0], cand("c:1", "canary", healthy=False)],
            policy,
        )
    # A color that names no subset at all is the client's mistake, named as such.
    with pytest.raises(InvalidArgument, match="'purple' names no subset") as info:
        p.pick(PickRequest("llm", color="purple"), pool, policy)
    assert info.value.field == "x-llm-color"


def test_split_follows_weights() -> None:
    policy = RoutingPolicy(split={"stable": 90, "canary": 10})
    rng = random.Random(7)
    subsets = Counter(
        subset_order(PickRequest("llm", split_point=split_point("", rng)), policy)[0][0]
        for _ in range(5000)
    )
    assert 0.08 < subsets["canary"] / 5000 < 0.12


def test_a_session_stays_on_one_subset() -> None:
    policy = RoutingPolicy(split={"stable": 50, "canary": 50})
    pool = [cand("s:1"), cand("c:1", "canary")]
    subsets_per_session = {
        key: {
            picker(seed)
            .pick(
                PickRequest("llm", session_key=key, split_point=split_point(key, random.Random())),
                pool,
                policy,
            )
            .subset
            for seed in range(10)
        }
        for key in (f"t/s{i}" for i in range(40))
    }
    assert all(len(s) == 1 for s in subsets_per_session.values())
    assert {next(iter(s)) for s in subsets_per_session.values()} == {"stable", "canary"}


def test_split_falls_back_when_the_chosen_subset_is_down_and_zero_weight_gets_nothing() -> None:
    policy = RoutingPolicy(split={"stable": 0, "canary": 100, "blue": 0.0001})
    pool = [cand("s:1"), cand("c:1", "canary", healthy=False), cand("b:1", "blue")]
    decision = picker().pick(PickRequest("llm", split_point=0.0), pool, policy)
    assert decision.candidate.address == "b:1" and decision.reasons[:2] == ("split", "fallback")
    with pytest.raises(Unavailable):
        picker().pick(PickRequest("llm"), pool[:2], policy)


def test_a_named_fallback_serves_a_subset_with_no_healthy_replica() -> None:
    """The local stack's split (stable 100, canary 0): stable's last replica down is
    UNAVAILABLE, unless the document names canary as stable's fallback; a color stays
    pinned either way."""
    pool = [cand("s:1", healthy=False), cand("c:1", "canary")]
    alone = RoutingPolicy(split={"stable": 100, "canary": 0})
    with pytest.raises(Unavailable):
        picker().pick(PickRequest("llm"), pool, alone)
    named = RoutingPolicy(split={"stable": 100, "canary": 0}, fallback={"stable": ["canary"]})
    decision = picker().pick(PickRequest("llm"), pool, named)
    assert decision.candidate.address == "c:1" and decision.fallback
    served = picker().pick(PickRequest("llm"), [cand("s:2"), *pool], named)
    assert served.candidate.address == "s:2" and not served.fallback
    pinned = RoutingPolicy(colors={"stable": "stable"}, fallback={"stable": ["canary"]})
    with pytest.raises(Unavailable):
        picker().pick(PickRequest("llm", color="stable"), pool, pinned)


def test_a_fallback_must_name_other_subsets() -> None:
    for bad in ("{fallback: {stable: [stable]}}", "{fallback: {stable: ['']}}"):
        with pytest.raises(InvalidDocument, match="fallback"):
            parse_policy(bad)


def test_unhealthy_and_other_model_replicas_are_never_picked() -> None:
    pool = [
        cand("down:1", healthy=False),
        cand("other:1", models=("llm_canary",)),
        cand("ok:1", load=ReportedLoad(waiting=50)),
    ]
    assert {
        picker(i).pick(PickRequest("llm"), pool, RoutingPolicy()).candidate.address
        for i in range(20)
    } == {"ok:1"}


def test_the_one_candidate_the_filters_leave_is_picked_without_weighing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(ctx: PickContext, candidates: Sequence[Candidate]) -> list[float]:
        raise AssertionError("a lone candidate was scored")

    p, policy = picker(), RoutingPolicy()
    for scorer, _ in p.profile(policy).scorers:
        monkeypatch.setattr(scorer, "score", refuse)
    request = PickRequest("llm", prefix=prefix_hashes("x" * 200), prompt_chars=200)
    decision = p.pick(request, [cand("s:1"), cand("s:2", healthy=False)], policy)
    assert decision.candidate.address == "s:1" and decision.reasons[-1] == "only_candidate"
    assert decision.uncached_tokens == 200  # the books still learn what it will prefill
    with pytest.raises(AssertionError, match="scored"):  # two left: they are weighed
        p.pick(request, [cand("s:1"), cand("s:2")], policy)


def test_region_order_prefers_local_then_the_documented_order() -> None:
    assert region_order("eu", ["us", "ap"], ["ap", "us", "sa", "eu"]) == ["eu", "us", "ap", "sa"]
    policy = RoutingPolicy(regions=["ap", "us"])
    pool = [cand("eu:1", healthy=False), cand("us:1", region="us"), cand("ap:1", region="ap")]
    decision = picker().pick(PickRequest("llm"), pool, policy)
    assert decision.candidate.address == "ap:1" and "failover" in decision.reasons
    local = picker().pick(PickRequest("llm"), [cand("eu:2"), *pool], policy)
    assert local.candidate.address == "eu:2" and "failover" not in local.reasons


def test_retries_avoid_replicas_that_failed_unless_nothing_else_is_left() -> None:
    pool = [cand("a:1"), cand("b:1")]
    request = PickRequest("llm", avoid=frozenset({"a:1"}))
    assert picker().pick(request, pool, RoutingPolicy()).candidate.address == "b:1"
    assert picker().pick(request, pool[:1], RoutingPolicy()).candidate.address == "a:1"


def test_load_score_prefers_short_queues_and_free_cache() -> None:
    pool = [
        cand("queued:1", load=ReportedLoad(running=4, waiting=3)),
        cand("full:1", load=ReportedLoad(running=4, kv_utilization=0.95)),
        cand("fine:1", load=ReportedLoad(running=5, kv_utilization=0.2)),
    ]
    decision = picker().pick(PickRequest("llm"), pool, RoutingPolicy())
    assert decision.candidate.address == "fine:1" and decision.reasons[-1] == "load"


def test_a_stream_the_router_ended_since_the_report_no_longer_counts() -> None:
    # Both reports show one running stream; the router has since ended a's and still has
    # b's open: a is idle, so it wins every time rather than half of the ties.
    pool = [
        Candidate(Endpoint(address="a:1"), LOCAL, ended=1, load=ReportedLoad(running=1)),
        Candidate(Endpoint(address="b:1"), LOCAL, in_flight=1, load=ReportedLoad(running=1)),
    ]
    picks = {
        picker(i).pick(PickRequest("llm"), pool, RoutingPolicy()).candidate.address
        for i in range(20)
    }
    assert picks == {"a:1"}
    # A stream opened after the report on a replica whose old one ended still counts.
    reopened = Candidate(
        Endpoint(address="a:1"), LOCAL, in_flight=1, ended=1, load=ReportedLoad(running=1)
    )
    assert load_cost(reopened, ScorerWeights()) == load_cost(pool[1], ScorerWeights())


def test_without_reports_the_routers_own_in_flight_count_spreads_load() -> None:
    pool = [
        Candidate(Endpoint(address="a:1"), LOCAL, in_flight=3),
        Candidate(Endpoint(address="b:1"), LOCAL, in_flight=1),
    ]
    assert picker().pick(PickRequest("llm"), pool, RoutingPolicy()).candidate.address == "b:1"


def test_streams_a_report_does_not_show_yet_count_as_load() -> None:
    # The router just sent a stream to "a"; a's last report predates it.
    pool = [cand("a:1", in_flight=1), cand("b:1")]
    assert picker().pick(PickRequest("llm"), pool, RoutingPolicy()).candidate.address == "b:1"
    # Once a report shows it, it is counted once, not twice.
    shown = [
        cand("a:1", in_flight=1, load=ReportedLoad(running=1)),
        cand("b:1", load=ReportedLoad(running=1)),
    ]
    assert {
        picker(i).pick(PickRequest("llm"), shown, RoutingPolicy()).candidate.address
        for i in range(20)
    } == {"a:1", "b:1"}


def test_ties_are_broken_at_random() -> None:
    pool = [cand(f"{n}:1") for n in "abc"]
    p = picker(1)
    assert {
        p.pick(PickRequest("llm"), pool, RoutingPolicy()).candidate.address for _ in range(50)
    } == {"a:1", "b:1", "c:1"}


def ask(prompt: str, session_key: str = "") -> PickRequest:
    return PickRequest("llm", prefix_hashes(prompt), len(prompt), session_key)


def test_prefix_affinity_sends_a_shared_prefix_back_to_its_replica() -> None:
    shared = "You are a helpful assistant. " * 40
    p, pool = picker(3), [cand(f"{n}:1") for n in "abcd"]
    first = p.pick(ask(shared + "Q1"), pool, RoutingPolicy())
    for q in range(2, 10):
        again = p.pick(ask(shared + f"Q{q}"), pool, RoutingPolicy())
        assert again.candidate.address == first.candidate.address
        assert again.reasons[-1] == "prefix"
    # Unless it is much busier than the others: the prefill saved is worth only so much.
    busy = [
        cand(c.address, load=ReportedLoad(waiting=5)) if c.address == first.candidate.address else c
        for c in pool
    ]
    moved = p.pick(ask(shared + "Q11"), busy, RoutingPolicy())
    assert moved.candidate.address != first.candidate.address


def test_a_prefix_is_named_alike_only_under_the_same_salt() -> None:
    """The router's index follows the engines' partitions: another tenant's prompt with
    the same prefix matches nothing it was not sent itself."""
    prompt = "s" * 300
    index = PrefixIndex()
    index.record(prefix_hashes(prompt, "tenant-a"), "a:1")
    assert index.matched_blocks(prefix_hashes(prompt, "tenant-a")) == {"a:1": 4}
    assert index.matched_blocks(prefix_hashes(prompt, "tenant-b")) == {}
    assert index.matched_blocks(prefix_hashes(prompt)) == {}


def test_a_longer_cached_prefix_is_worth_more_load() -> None:
    short, long, fresh = "s" * 256, "l" * 2048, "f" * 2200
    p = picker(5)
    p.prefixes.record(prefix_hashes(short), "a:1")
    p.prefixes.record(prefix_hashes(long), "a:1")
    a_busier = [cand("a:1", load=ReportedLoad(running=3)), cand("b:1", load=ReportedLoad())]
    # Prompts mostly new (under half of them seen: no prefix affinity), so the prefill
    # scorer weighs what is cached: 2000 tokens saved outweigh 3 running sequences; 250
    # tokens do not.
    long_pick = p.pick(ask(long + fresh), a_busier, RoutingPolicy())
    assert long_pick.candidate.address == "a:1" and long_pick.reasons[-1] == "prefix"
    assert p.pick(ask(short + fresh), a_busier, RoutingPolicy()).candidate.address == "b:1"


def test_a_conversation_resent_whole_stays_with_its_cached_history() -> None:
    """No session id: the client sends the history with every turn (OpenAI's messages).
    Most of the prompt was sent to one replica before, so it stays there while somewhat
    busier, as a session would, however little the prefill scorer makes of it."""
    history, policy = "h" * 300, RoutingPolicy()
    p = picker(6)
    p.prefixes.record(prefix_hashes(history), "a:1")
    pool = [cand("a:1", load=ReportedLoad(running=3)), cand("b:1"), cand("c:1")]
    stayed = p.pick(ask(history + " and then?"), pool, policy)
    assert stayed.candidate.address == "a:1" and stayed.reasons[-1] == "prefix"
    # Saturated, or far busier than the least busy, it goes elsewhere.
    for load in (ReportedLoad(running=6), ReportedLoad(running=1, waiting=2)):
        pool[0] = cand("a:1", load=load)
        assert p.pick(ask(history + " and then?"), pool, policy).candidate.address != "a:1"


def test_prefix_affinity_needs_most_of_the_prompt_seen() -> None:
    seen, fresh = "h" * 256, "n" * 640  # 4 blocks of 14 seen: under half
    p = picker(7)
    p.prefixes.record(prefix_hashes(seen), "a:1")
    pool = [cand("a:1", load=ReportedLoad(running=3)), cand("b:1")]
    picked = p.pick(ask(seen + fresh), pool, RoutingPolicy())
    assert picked.candidate.address == "b:1" and picked.reasons[-1] != "prefix"


def test_replicas_holding_the_same_prefix_share_it_by_load() -> None:
    preamble = "p" * 512
    p = picker(8)
    for address in ("a:1", "b:1"):
        p.prefixes.record(prefix_hashes(preamble), address)
    pool = [cand("a:1", load=ReportedLoad(running=2)), cand("b:1"), cand("c:1")]
    picked = p.pick(ask(preamble + "?"), pool, RoutingPolicy())
    assert picked.candidate.address == "b:1" and picked.reasons[-1] == "prefix"


def test_session_affinity_sticks_until_the_replica_is_saturated() -> None:
    p, policy = picker(4), RoutingPolicy()
    pool = [cand(f"{n}:1") for n in "abcd"]
    home = p.pick(ask("hi", "t/s"), pool, policy).candidate.address

    def with_home(load: dict[str, float]) -> list[Candidate]:
        return [cand(home, load=load) if c.address == home else c for c in pool]

    # Somewhat busier than the others, the session's replica keeps it...
    again = p.pick(ask("hi", "t/s"), with_home(ReportedLoad(running=3)), policy)
    assert again.candidate.address == home and again.reasons[-1] == "affinity"
    # ...until it is saturated: a queue, a full cache, or far more load than the least.
    for load in (
        ReportedLoad(running=1, waiting=2),
        ReportedLoad(kv_utilization=0.95),
        ReportedLoad(running=6),
    ):
        moved = p.pick(ask("hi", "t/s"), with_home(load), policy).candidate.address
        assert moved != home
        # The session follows it to where it went.
        assert p.pick(ask("hi", "t/s"), pool, policy).candidate.address == moved
        p.sessions.set("t/s", home)


def test_round_robin_baseline_takes_turns_blind_to_load() -> None:
    policy = RoutingPolicy(algorithm="round_robin")
    pool = [cand("a:1", load=ReportedLoad(waiting=100)), cand("b:1"), cand("c:1")]
    p = picker()
    picks = [p.pick(PickRequest("llm"), pool, policy).candidate.address for _ in range(6)]
    assert picks == ["a:1", "b:1", "c:1", "a:1", "b:1", "c:1"]


def test_scorer_weights_come_from_the_document() -> None:
    pool = [
        cand("queue:1", load=ReportedLoad(waiting=2)),
        cand("cache:1", load=ReportedLoad(kv_utilization=0.9)),
    ]
    queue_averse = RoutingPolicy(weights=ScorerWeights(waiting=10, kv_utilization=1))
    cache_averse = RoutingPolicy(weights=ScorerWeights(waiting=1, kv_utilization=10))
    assert picker().pick(PickRequest("llm"), pool, queue_averse).candidate.address == "cache:1"
    assert picker().pick(PickRequest("llm"), pool, cache_averse).candidate.address == "queue:1"


def test_replicas_sharing_a_device_fill_its_busiest_engines_first() -> None:
    # Four engines on one device that runs two at once: the two busiest take the work
    # while one of them has room, though idle engines cost less by load.
    policy = RoutingPolicy(packing=DevicePackingParams(engines_at_once=2, fill=4))
    pool = [
        cand("a:1", device="host", load=ReportedLoad(running=3)),
        cand("b:1", device="host", load=ReportedLoad(running=1)),
        cand("c:1", device="host"),
        cand("d:1", device="host"),
    ]
    picks = {picker(i).pick(PickRequest("llm"), pool, policy).candidate.address for i in range(20)}
    assert picks == {"b:1"}  # the less loaded of the two busiest
    # Both full: every engine of the device is open again, and load spreads to the idle.
    full = [
        cand("a:1", device="host", load=ReportedLoad(running=4)),
        cand("b:1", device="host", load=ReportedLoad(running=5)),
        cand("c:1", device="host"),
        cand("d:1", device="host", load=ReportedLoad(running=1)),
    ]
    assert picker().pick(PickRequest("llm"), full, policy).candidate.address == "c:1"


def test_an_idle_device_starts_the_same_engines_and_counts_streams_not_yet_reported() -> None:
    policy = RoutingPolicy(packing=DevicePackingParams(engines_at_once=1, fill=8))
    pool = [cand(f"{n}:1", device="gpu-0") for n in "dcba"]
    assert {
        picker(i).pick(PickRequest("llm"), pool, policy).candidate.address for i in range(20)
    } == {"a:1"}
    # A stream the router just sent to c makes c the busiest before any report shows it.
    pool[1] = cand("c:1", device="gpu-0", in_flight=1)
    assert picker().pick(PickRequest("llm"), pool, policy).candidate.address == "c:1"


def test_packing_is_per_device_and_leaves_replicas_of_their_own_to_load() -> None:
    policy = RoutingPolicy(packing=DevicePackingParams(engines_at_once=1, fill=8))
    pool = [
        cand("a:1", device="gpu-0", load=ReportedLoad(running=2)),
        cand("b:1", device="gpu-0"),
        cand("c:1", device="gpu-1", load=ReportedLoad(running=1)),
        cand("d:1", device="gpu-1"),
        cand("e:1", load=ReportedLoad(running=1)),
    ]
    # b and d wait behind their devices' busiest; of a, c and e, the least loaded wins.
    assert {
        picker(i).pick(PickRequest("llm"), pool, policy).candidate.address for i in range(20)
    } == {"c:1", "e:1"}


def test_a_conversation_outweighs_packing() -> None:
    policy = RoutingPolicy(packing=DevicePackingParams(engines_at_once=1, fill=8))
    p = picker()
    pool = [cand("a:1", device="host"), cand("b:1", device="host")]
    p.sessions.set("s", "b:1", "stable")
    request = PickRequest("llm", session_key="s")
    assert p.pick(request, pool, policy).candidate.address == "b:1"


def test_prefix_index_matches_leading_blocks_only_and_stays_bounded() -> None:
    index = PrefixIndex(capacity=100)
    a = prefix_hashes("x" * 64 * 4)
    index.record(a, "r1")
    index.record(a[:2], "r2")
    assert index.matched_blocks(a) == {"r1": 4, "r2": 2}
    diverging = prefix_hashes("x" * 64 + "y" * 64 * 3)
    assert index.matched_blocks(diverging) == {"r1": 1, "r2": 1}
    for i in range(300):
        index.record(prefix_hashes(f"{i:064d}"), "r3")
    assert index.matched_blocks(a) == {}


def test_prefill_already_queued_at_a_replica_counts_as_load() -> None:
    queued = Candidate(
        Endpoint(address="a:1"), LOCAL, in_flight=1, prefilling=2000, load=ReportedLoad(running=1)
    )
    idle = cand("b:1", load=ReportedLoad(running=2))
    decision = picker().pick(ask("x" * 1000), [queued, idle], RoutingPolicy())
    assert decision.candidate.address == "b:1" and decision.uncached_tokens == 1000


def test_a_replica_is_alive_by_its_reports() -> None:
    stale = 1.0
    assert reports_alive(None, False, 100.0, stale)  # not reported yet: unknown, allowed
    assert not reports_alive(None, True, 100.0, stale)  # its stream broke after reports
    assert reports_alive(99.5, False, 100.0, stale)
    assert not reports_alive(98.0, False, 100.0, stale)  # went silent


class Cooler(Scorer):
    """A scorer written here: prefers replicas whose engine reports a low temperature,
    a signal nothing else in the mesh knows of."""

    def score(self, ctx: PickContext, candidates: Sequence[Candidate]) -> list[float]:
        return [1.0 - min(c.metric("gpu_temperature_c") / 100, 1.0) for c in candidates]


def test_a_scorer_registered_by_name_changes_the_pick() -> None:
    register("cooler")(Cooler)
    try:
        hot = cand("hot:1", load={**ReportedLoad(), "gpu_temperature_c": 90})
        cool = cand("cool:1", load={**ReportedLoad(running=1), "gpu_temperature_c": 40})
        by_load = picker().pick(PickRequest("llm"), [hot, cool], RoutingPolicy())
        assert by_load.candidate.address == "hot:1"
        policy = parse_policy(
            "scheduling: {scorers: [{type: cooler, weight: 10}, {type: running}]}"
        )
        by_heat = picker().pick(PickRequest("llm"), [hot, cool], policy)
        assert by_heat.candidate.address == "cool:1"
    finally:
        del SCORERS["cooler"]


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ("scheduling: {scorers: [{type: nope}]}", "unknown scorer 'nope'"),
        ("scheduling: {filters: [healthy, sideways]}", "unknown filter 'sideways'"),
        ("scheduling: {picker: {type: coin}}", "unknown picker 'coin'"),
        ("scheduling: {scorers: [{type: queue, params: {scale: -1}}]}", "scale"),
        ("scheduling: {scorers: [{type: queue, params: {depth: 3}}]}", "depth"),
        ("scheduling: {scorers: [{type: queue, weight: -2}]}", "weight"),
        ("packing: {engines_at_once: 0}", "engines_at_once"),
        ("scheduling: {scorers: [{type: device_packing, params: {fill: 0}}]}", "fill"),
    ],
)
def test_an_invalid_profile_is_rejected_whole(document: str, problem: str) -> None:
    with pytest.raises(InvalidDocument, match=problem):
        parse_policy(document)


def test_a_profile_in_the_document_replaces_the_default() -> None:
    pool = [
        cand("queued:1", load=ReportedLoad(waiting=3)),
        cand("busy:1", load=ReportedLoad(running=9)),
    ]
    default = picker().pick(PickRequest("llm"), pool, RoutingPolicy())
    assert default.candidate.address == "busy:1"  # a queue costs more than running work
    only_running = parse_policy("scheduling: {scorers: [{type: running}]}")
    assert picker().pick(PickRequest("llm"), pool, only_running).candidate.address == "queued:1"
    rr = parse_policy("scheduling: {picker: {type: round_robin}}")
    assert [picker().pick(PickRequest("llm"), pool, rr).reasons[-1]] == ["round_robin"]
