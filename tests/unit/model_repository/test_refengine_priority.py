"""The reference engine's priority scheduling: preemption by priority, the starvation
bound, first words in short steps."""

from __future__ import annotations

from typing import Any

import pytest
from refengine import (
    RequestError,
)
from refengine.contract import (
    parse_priority,
)

from tests.unit.model_repository.engines import (
    drain,
    first_word_tokens,
    make_engine,
    run,
    submit_at,
    urgent_kw,
)


class TestPriority:
    def test_an_urgent_arrival_into_a_full_batch_runs_in_the_next_step(self) -> None:
        """Two sheddable generations fill the batch; a critical one arrives: it runs in
        the next step, one sheddable waits, and the preempted generation's text is what
        it would have been without the preemption."""
        engine = make_engine(max_running=2)
        low = [
            submit_at(engine, f"long {i}", 2, max_tokens=40, ignore_eos=True, seed=i)
            for i in (1, 2)
        ]
        for _ in range(5):
            engine.step()
        urgent = submit_at(engine, "now", 0, max_tokens=3, ignore_eos=True, seed=3)
        engine.step()
        assert urgent.deltas, "the urgent sequence got no token in the next step"
        assert engine.stats.preemptions_by_priority == {2: 1}
        while not urgent.done.is_set():
            engine.step()
        # Published as the urgent one ended: the preempted one waits, counted at its
        # priority (a router reads whether work as urgent as its request's queues).
        assert engine.stats.waiting_by_priority == {2: 1} and engine.stats.waiting == 1
        drain(engine)
        for i, sink in zip((1, 2), low, strict=True):
            alone = run(make_engine(), f"long {i}", max_tokens=40, ignore_eos=True, seed=i)
            assert sink.text == alone.text and sink.tokens == 40
        assert engine.stats.recomputed_tokens > 0 and engine.stats.preempted_seconds > 0
        assert engine.pool.stats().used == 0

    def test_an_urgent_prompt_is_prefilled_in_a_step_of_its_own(self) -> None:
        """Room for it (no preemption): the step that prefills it leaves out the less
        urgent decodes and, while it does, an equal priority's stream too; both go on in
        the next one."""
        engine = make_engine()
        low = [submit_at(engine, f"low {i}", 2, max_tokens=20, ignore_eos=True) for i in (1, 2)]
        peer = submit_at(engine, "peer", 0, max_tokens=20, ignore_eos=True)
        for _ in range(3):
            engine.step()
        before = [s.tokens_so_far() for s in (*low, peer)]
        urgent = submit_at(engine, "urgent", 0, max_tokens=1, ignore_eos=True)
        engine.step()
        assert urgent.done.is_set() and [s.tokens_so_far() for s in (*low, peer)] == before
        engine.step()
        assert [s.tokens_so_far() for s in (*low, peer)] == [b + 1 for b in before]
        assert engine.stats.preemptions == 0
        drain(engine)

    def test_no_pause_for_a_first_word_while_its_equals_wait_for_room(self) -> None:
        """The batch is full and the less urgent stream may not be preempted again: a
        second urgent request waits, so the first one's first-word steps keep the less
        urgent stream in (its tier needs the batch's throughput)."""
        engine = make_engine(max_running=2, urgent_first_tokens=8, max_preemptions=0)
        low = submit_at(engine, "low", 2, max_tokens=30, ignore_eos=True)
        for _ in range(3):
            engine.step()
        first = submit_at(engine, "first", 0, max_tokens=20, ignore_eos=True)
        engine.step()  # its prompt's step: nothing waits yet, the low stream pauses
        before = low.tokens_so_far()
        submit_at(engine, "second", 0, max_tokens=20, ignore_eos=True)
        engine.step()
        assert first.tokens_so_far() == 2 and low.tokens_so_far() == before + 1
        assert engine.stats.first_word_steps == 1
        drain(engine)

    def test_a_batch_of_one_priority_does_not_pause_for_a_first_word(self) -> None:
        """Nothing less urgent runs: a new arrival's prompt shares its step with the
        streams of its equals, as continuous batching has it."""
        engine = make_engine(urgent_first_tokens=8)
        peers = [submit_at(engine, f"peer {i}", 1, max_tokens=20, ignore_eos=True) for i in (1, 2)]
        for _ in range(9):  # past their own first words
            engine.step()
        before = [s.tokens_so_far() for s in peers]
        submit_at(engine, "new", 1, max_tokens=4, ignore_eos=True)
        engine.step()
        assert [s.tokens_so_far() for s in peers] == [b + 1 for b in before]
        ran = 9 + 1 + drain(engine)  # an idle call of step() is not a step
        assert engine.stats.first_word_steps == 0 and engine.stats.step_seconds > 0
        assert engine.stats.steps == ran == 20  # the peers' 20 tokens, one a step

    @pytest.mark.parametrize("bound", [10, 2])
    def test_an_urgent_sequences_first_word_comes_in_steps_of_its_own(self, bound: int) -> None:
        """The less urgent decodes pause for the urgent one's prefill and its tokens until
        its first word has ended (a space after it; here at token ``ends``, known from a
        run alone), at most ``urgent_first_tokens`` of them, then go on beside it."""
        seed, ends = next(
            (seed, ends)
            for seed in range(50)
            if 3 <= (ends := first_word_tokens(run(make_engine(), "urgent", **urgent_kw(seed)))) < 8
        )
        paused = min(ends, bound)
        engine = make_engine(urgent_first_tokens=bound)
        low = submit_at(engine, "low", 2, max_tokens=30, ignore_eos=True)
        for _ in range(3):
            engine.step()
        before = low.tokens_so_far()
        urgent = submit_at(engine, "urgent", 0, **urgent_kw(seed))
        for _ in range(paused):
            engine.step()
        assert urgent.tokens_so_far() == paused and low.tokens_so_far() == before
        engine.step()
        assert urgent.tokens_so_far() == paused + 1 and low.tokens_so_far() == before + 1
        # Counted: the steps that left the less urgent work out, and their time (the
        # urgent work in them included).
        stats = engine.stats
        assert stats.first_word_steps == paused
        assert 0 < stats.first_word_step_seconds < stats.step_seconds
        drain(engine)

    def test_less_urgent_prompts_are_prefilled_a_bounded_chunk_per_step(self) -> None:
        """With lower_prefill_tokens=8 and an urgent sequence running, a step computes at
        most 8 tokens of less urgent prompts (the next urgent arrival waits for a short
        step); their text is what it would have been unbounded. Without a more urgent
        sequence running, there is no bound."""
        prompts = ("a less urgent prompt of some length", "and a second one, just as long")
        engine = make_engine(lower_prefill_tokens=8)
        urgent = submit_at(engine, "urgent", 0, max_tokens=60, ignore_eos=True)
        engine.step()
        low = [submit_at(engine, p, 2, max_tokens=5, ignore_eos=True, seed=1) for p in prompts]
        for _ in range(4):
            computed = engine.stats.prefill_tokens
            engine.step()
            assert engine.stats.prefill_tokens - computed <= 8
        drain(engine)
        for prompt, sink in zip(prompts, low, strict=True):
            alone = run(make_engine(), prompt, max_tokens=5, ignore_eos=True, seed=1)
            assert sink.text == alone.text
        assert urgent.tokens == 60

        alone_tier = make_engine(lower_prefill_tokens=8)
        for p in prompts:
            submit_at(alone_tier, p, 2, max_tokens=5, ignore_eos=True)
        alone_tier.step()
        assert alone_tier.stats.prefill_tokens >= sum(len(p) for p in prompts)
        drain(alone_tier)

    def test_the_victim_among_equals_is_one_already_streaming(self) -> None:
        """A long prompt is still being prefilled (no token yet) beside an older stream:
        an urgent arrival preempts the stream, whose client only sees a pause, not the
        newer request whose first token it would put off."""
        engine = make_engine(max_running=2, max_batched_tokens=8)
        streaming = submit_at(engine, "old", 2, max_tokens=30, ignore_eos=True)
        engine.step()
        prefilling = submit_at(engine, "a prompt longer than one step", 2, max_tokens=4)
        engine.step()
        assert streaming.tokens_so_far() > 0 and prefilling.tokens_so_far() == 0
        before = streaming.tokens_so_far()
        submit_at(engine, "now", 0, max_tokens=2, ignore_eos=True)
        for _ in range(3):
            engine.step()
        assert streaming.tokens_so_far() == before and engine.stats.preemptions == 1
        drain(engine)
        assert prefilling.done.is_set() and streaming.tokens == 30

    def test_the_queue_serves_the_most_urgent_first_then_in_arrival_order(self) -> None:
        engine = make_engine(max_running=1)
        order: list[str] = []
        sinks = {
            name: submit_at(engine, name, priority, max_tokens=1, ignore_eos=True)
            for name, priority in (("first", 1), ("second", 1), ("urgent", 0), ("late", 2))
        }
        while not all(s.done.is_set() for s in sinks.values()):
            engine.step()
            order += [n for n, s in sinks.items() if s.done.is_set() and n not in order]
        assert order == ["urgent", "first", "second", "late"]
        assert engine.stats.preemptions == 0  # one token each: nothing was displaced

    def test_a_sequence_preempted_often_enough_is_preempted_no_more(self) -> None:
        engine = make_engine(max_running=1, max_preemptions=1)
        low = submit_at(engine, "low", 2, max_tokens=30, ignore_eos=True)
        engine.step()
        first = submit_at(engine, "urgent one", 0, max_tokens=2, ignore_eos=True)
        while not first.done.is_set():
            engine.step()
        resumed = len(low.deltas)
        while len(low.deltas) == resumed:  # the low one runs again
            engine.step()
        second = submit_at(engine, "urgent two", 0, max_tokens=2, ignore_eos=True)
        engine.step()
        assert not second.deltas  # it waits: the low one has had its one preemption
        drain(engine)
        assert low.tokens == 30 and second.tokens == 2
        assert engine.stats.preemptions_by_priority == {2: 1}

    @pytest.mark.parametrize("value", [-1, 1.5, "0", True])
    def test_a_priority_that_is_not_a_non_negative_integer_is_refused(self, value: Any) -> None:
        with pytest.raises(RequestError, match="scheduling_priority"):
            parse_priority({"scheduling_priority": value})
        assert parse_priority({}) == 0 and parse_priority({"scheduling_priority": 3}) == 3
