"""The reference engine's loop: continuous batching, the paged KV cache and prefix caching,
cancellation, streaming intervals."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from refengine import (
    Engine,
    EngineConfig,
    GenerationRequest,
    RequestError,
    SamplingParams,
    Transformer,
)
from refengine.contract import (
    StreamGap,
    parse_cache_salt,
    parse_stream_gap,
)
from refengine.tokenizer import BOS, EOS

from tests.unit.model_repository.engines import (
    SMALL,
    BrokenSink,
    RecordingSink,
    drain,
    first_word_tokens,
    make_engine,
    run,
    submit,
    submit_at,
)


class TestEngine:
    def test_a_requests_statistics_are_published_before_its_last_response(self) -> None:
        published: list[int] = []  # prompt tokens, as each publication reported them
        engine = Engine(
            Transformer(SMALL, seed=0), on_stats=lambda stats: published.append(stats.prompt_tokens)
        )
        run(engine, "warm", max_tokens=2, ignore_eos=True)  # a publication just now

        class Noting(RecordingSink):
            counted_at_finish = -1

            def finish(self, *args: Any, **kw: Any) -> None:
                self.counted_at_finish = published[-1]
                super().finish(*args, **kw)

        sink = Noting()
        submit(engine, "counted", sink, max_tokens=2, ignore_eos=True)
        drain(engine)
        # within the publications' interval, yet counted before its last response went
        assert sink.counted_at_finish == engine.stats.prompt_tokens
        assert engine.stats.prompt_tokens > len("warm")

    def test_requests_submitted_during_a_step_are_not_published_as_queued(self) -> None:
        """Three arrive while a step computes (another thread submits; here, the model's
        forward pass): the engine has room for them, so the statistics published at the
        step's end show no queue, which a router would read as saturation."""
        engine = make_engine()
        submit(engine, "first", max_tokens=8, ignore_eos=True)
        forward = engine.model.forward
        arrived: list[RecordingSink] = []

        def forward_while_three_arrive(*args: Any, **kw: Any) -> Any:
            if not arrived:
                arrived.extend(submit(engine, f"then {i}", max_tokens=8) for i in range(3))
            return forward(*args, **kw)

        engine.model.forward = forward_while_three_arrive  # type: ignore[method-assign]
        engine.step()
        assert len(arrived) == 3 and engine.stats.running == 1  # published at this step
        assert engine.stats.waiting == 0 and not engine.stats.waiting_by_priority
        drain(engine)
        assert all(sink.done.is_set() for sink in arrived)

    def test_streams_exactly_max_tokens_then_length(self) -> None:
        sink = run(make_engine(), "hello", max_tokens=20, ignore_eos=True, seed=1)
        assert sink.final is not None and sink.final[2] == "length"
        assert sink.tokens == 20
        assert len(sink.text) == 20
        assert len(sink.deltas) >= 19

    def test_same_seed_same_text_whatever_else_is_in_the_batch(self) -> None:
        alone = run(make_engine(), "seeded", max_tokens=30, seed=42, ignore_eos=True).text
        engine = make_engine()
        others = [
            submit(engine, f"noise {i}" * (i + 1), max_tokens=40, ignore_eos=True) for i in range(5)
        ]
        mine = submit(engine, "seeded", max_tokens=30, seed=42, ignore_eos=True)
        drain(engine)
        assert mine.text == alone
        assert all(o.final is not None for o in others)
        other_seed = run(make_engine(), "seeded", max_tokens=30, seed=43, ignore_eos=True)
        assert other_seed.text != alone

    def test_chunked_prefill_gives_the_same_text_as_one_shot(self) -> None:
        prompt = "a prompt that takes several steps to prefill " * 4
        for kw in ({"temperature": 0.0}, {"seed": 7}):
            whole = run(make_engine(), prompt, max_tokens=24, ignore_eos=True, **kw).text
            engine = make_engine(max_batched_tokens=16)
            sink = submit(engine, prompt, max_tokens=24, ignore_eos=True, **kw)
            steps = drain(engine)
            assert sink.text == whole
            assert steps >= len(prompt) // 16 + 23  # the prompt went through in chunks

    def test_a_long_prefill_does_not_stall_running_streams(self) -> None:
        engine = make_engine(max_batched_tokens=32)
        running = submit(engine, "short", max_tokens=200, ignore_eos=True)
        engine.step()
        before = len(running.deltas)
        long = submit(engine, "x" * 200, max_tokens=4, ignore_eos=True)
        steps = 0
        while not long.deltas:  # the long prompt is prefilled, 31 tokens a step...
            engine.step()
            steps += 1
        assert steps >= 200 // 32
        # ...while the running stream got a token every one of those steps.
        assert len(running.deltas) - before >= steps
        drain(engine)

    def test_sequences_are_batched_in_one_step(self) -> None:
        engine = make_engine()
        sinks = [submit(engine, f"prompt {i}", max_tokens=10, ignore_eos=True) for i in range(8)]
        steps = drain(engine)
        assert steps == 10  # all eight decoded together, not one after another
        assert all(s.tokens == 10 for s in sinks)

    def test_stop_string_ends_generation_before_it(self) -> None:
        free = run(make_engine(), "stops", max_tokens=60, temperature=0.0, ignore_eos=True).text
        stop = free[20:23]
        cut = run(
            make_engine(), "stops", max_tokens=60, temperature=0.0, ignore_eos=True, stop=[stop]
        )
        assert cut.final is not None and cut.final[2] == "stop"
        assert cut.text == free[: free.index(stop)]

    def test_bad_words_never_come_out(self) -> None:
        """vLLM's bad_words: a word's last token is masked where the output's tokens
        before it spell the rest of it, so the output never has it; a one-token word is
        never drawn at all. The rest of the text goes on as the model would."""
        kw: dict[str, Any] = {"max_tokens": 60, "temperature": 0.0, "ignore_eos": True}
        free = run(make_engine(), "words", **kw).text
        word, single = free[10:13], free[5]
        assert word in free and single in free
        held = run(make_engine(), "words", bad_words=[word, single], **kw).text
        assert word not in held and single not in held
        assert held[:5] == free[:5]  # the same until the first ban bites
        seeded = run(
            make_engine(), "words", bad_words=[word], seed=3, max_tokens=60, ignore_eos=True
        )
        assert word not in seeded.text
        # The allowed tokens all banned after the first: the output ends there, nothing
        # forced out of the mask.
        cornered = run(
            make_engine(), "words", allowed_token_ids=[ord("a"), ord("b")],
            bad_words=["aa", "ab", "ba", "bb"], max_tokens=8, ignore_eos=True,
        )  # fmt: skip
        assert cornered.final is not None and cornered.final[2] == "stop"
        assert len(cornered.text) == 1 and cornered.text in "ab"

    def test_only_allowed_tokens_are_generated(self) -> None:
        """vLLM's allowed_token_ids: the output has only them (the end of sequence only if
        listed); a list the output mask leaves empty is refused, not sampled from."""
        allowed = [ord(c) for c in "ab "]
        for seed in range(3):
            out = run(make_engine(), "only", max_tokens=30, seed=seed, allowed_token_ids=allowed)
            assert out.text and set(out.text) <= set("ab ")
            assert out.final is not None and out.final[2] == "length"  # EOS not listed
        with pytest.raises(RequestError, match="allowed_token_ids: none of them"):
            run(make_engine(), "only", max_tokens=4, allowed_token_ids=[BOS])
        with pytest.raises(RequestError, match="allowed_token_ids: none of them"):
            run(make_engine(), "only", max_tokens=4, allowed_token_ids=[EOS], min_tokens=2)
        ended = run(make_engine(), "only", max_tokens=4, allowed_token_ids=[EOS])
        assert ended.text == "" and ended.final is not None and ended.final[2] == "stop"

    def test_a_stop_string_kept_in_the_text_when_asked(self) -> None:
        kw: dict[str, Any] = {"max_tokens": 60, "temperature": 0.0, "ignore_eos": True}
        free = run(make_engine(), "stops", **kw).text
        stop = free[20:23]
        kept = run(
            make_engine(), "stops", stop=["zzzz", stop], include_stop_str_in_output=True, **kw
        )
        assert kept.final is not None and kept.final[2] == "stop"
        assert kept.text == free[: free.index(stop) + len(stop)]

    def test_a_stop_token_ends_generation_with_its_text(self) -> None:
        """vLLM's stop_token_ids: the first of them generated ends the stream, its text
        kept (a token that is not special); before min_tokens, none may come."""
        kw: dict[str, Any] = {"max_tokens": 60, "temperature": 0.0, "ignore_eos": True}
        free = run(make_engine(), "stops", **kw).text
        token = ord(free[20])
        cut = run(make_engine(), "stops", stop_token_ids=[token, 255], **kw)
        assert cut.final is not None and cut.final[2] == "stop"
        assert cut.text == free[: free.index(chr(token)) + 1]
        late = run(make_engine(), "stops", stop_token_ids=[token], min_tokens=25, **kw)
        assert chr(token) not in late.text[:25]
        with pytest.raises(RequestError, match=r"stop_token_ids: 258 is not a token"):
            run(make_engine(), "stops", stop_token_ids=[258], **kw)

    def test_cancellation_stops_generation_and_frees_blocks(self) -> None:
        engine = make_engine()
        sink = submit(
            engine, "cancel me", RecordingSink(cancel_after=3), max_tokens=200, ignore_eos=True
        )
        drain(engine)
        assert sink.final is not None and sink.final[2] == "cancelled"
        assert sink.tokens < 200
        assert engine.stats.finished["cancelled"] == 1
        assert engine.pool.stats().used == 0

    def test_non_streaming_returns_prompt_and_text_once(self) -> None:
        sink = run(make_engine(), "whole", max_tokens=8, ignore_eos=True, stream=False, seed=0)
        assert sink.deltas == []
        assert sink.final is not None
        assert sink.final[0].startswith("whole") and len(sink.final[0]) == 5 + 8

    def test_prompt_longer_than_the_context_is_refused(self) -> None:
        with pytest.raises(RequestError, match="text_input"):
            make_engine().submit(GenerationRequest("x" * 300), RecordingSink())

    def test_request_bigger_than_the_whole_cache_is_refused(self) -> None:
        with pytest.raises(RequestError, match="KV blocks"):
            submit(make_engine(kv_blocks=4, block_size=4), "x" * 10, max_tokens=20)

    def test_generation_stops_at_the_context_length(self) -> None:
        sink = run(make_engine(), "y" * 240, max_tokens=100, ignore_eos=True)
        assert sink.final is not None and sink.final[2] == "length"
        assert sink.tokens == SMALL.max_context - 241

    def test_a_full_pool_makes_new_requests_wait_not_fail(self) -> None:
        engine = make_engine(kv_blocks=12, block_size=4)
        sinks = [submit(engine, f"req {i} " * 2, max_tokens=20, ignore_eos=True) for i in range(6)]
        drain(engine)
        assert [s.final[2] for s in sinks if s.final] == ["length"] * 6
        assert all(s.tokens == 20 and not s.error for s in sinks)

    def test_preempted_sequences_are_recomputed_and_finish_once(self) -> None:
        engine = make_engine(kv_blocks=10, block_size=4)
        sinks = [submit(engine, f"p{i}", max_tokens=30, ignore_eos=True, seed=i) for i in range(3)]
        drain(engine)
        assert engine.stats.preemptions > 0
        for i, sink in enumerate(sinks):
            assert sink.final is not None and sink.final[2] == "length"
            assert sink.tokens == 30 and len(sink.text) == 30
            alone = run(make_engine(), f"p{i}", max_tokens=30, ignore_eos=True, seed=i)
            assert sink.text[:8] == alone.text[:8]
        assert engine.pool.stats().used == 0

    def test_shared_prefix_is_read_from_the_cache(self) -> None:
        engine = make_engine(block_size=4)
        prefix = "a long shared system prompt " * 3
        run(engine, prefix + "first", max_tokens=2, temperature=0.0)
        prefill_before = engine.stats.prefill_tokens
        second = run(engine, prefix + "second", max_tokens=2, temperature=0.0)
        computed = engine.stats.prefill_tokens - prefill_before
        assert engine.stats.prefix_hit_tokens >= len(prefix) - 4
        assert computed <= len("second") + 1 + 4
        uncached = run(make_engine(block_size=4), prefix + "second", max_tokens=2, temperature=0.0)
        assert second.text == uncached.text

    def test_a_cache_salt_partitions_the_prefix_cache(self) -> None:
        """A prompt reuses only blocks computed under its own salt: another salt, or none,
        computes the prefix afresh (and its text is the same)."""
        engine = make_engine(block_size=4)
        prefix = "a long shared system prompt " * 3

        def hits(salt: str, prompt: str) -> tuple[int, str]:
            before = engine.stats.prefix_hit_tokens
            request = GenerationRequest(
                prefix + prompt, sampling=SamplingParams(max_tokens=2, temperature=0.0),
                cache_salt=salt,
            )  # fmt: skip
            sink = RecordingSink()
            engine.submit(request, sink)
            drain(engine)
            return engine.stats.prefix_hit_tokens - before, sink.text

        assert hits("tenant-a", "first")[0] == 0
        other, unsalted = hits("tenant-b", "second"), hits("", "second")
        assert other[0] == 0 and unsalted[0] == 0 and other[1] == unsalted[1]
        assert hits("tenant-a", "third")[0] >= len(prefix) - 4
        assert hits("", "fourth")[0] >= len(prefix) - 4  # the unsalted share among themselves

    @pytest.mark.parametrize("value", [3, None, "x" * 257])
    def test_a_cache_salt_that_is_not_a_short_string_is_refused(self, value: Any) -> None:
        with pytest.raises(RequestError, match="cache_salt"):
            parse_cache_salt({"cache_salt": value})
        assert parse_cache_salt({}) == "" and parse_cache_salt({"cache_salt": "t"}) == "t"

    def test_the_first_response_says_how_much_of_the_prompt_was_cached(self) -> None:
        """Once, on the first response: the prompt's full blocks found in the cache (a
        preemption's recompute, which hits the sequence's own blocks, is not counted)."""
        engine = make_engine(block_size=4)
        prefix = "a long shared system prompt " * 3  # with BOS: 85 tokens, 21 full blocks

        def reported(prompt: str) -> list[int]:
            sink = RecordingSink()
            sampling = SamplingParams(max_tokens=5, ignore_eos=True)
            request = GenerationRequest(prompt, sampling=sampling, return_num_cached_tokens=True)
            engine.submit(request, sink)
            drain(engine)
            return [
                d.num_cached_tokens for d in sink.details if d and d.num_cached_tokens is not None
            ]

        assert reported(prefix + "first") == [0]
        assert reported(prefix + "second") == [84]
        assert reported(prefix + "first") == [88]  # its first answer's blocks too
        plain = run(engine, prefix + "third", max_tokens=2)  # not asked: not reported
        assert all(d is None or d.num_cached_tokens is None for d in plain.details)

    def test_the_first_response_has_the_prompts_ids_once_and_only_when_asked(self) -> None:
        """vLLM's return_token_ids, the prompt's side: the ids as the engine read them (BOS
        first), on the first response alone."""
        engine = make_engine()
        sink = RecordingSink()
        sampling = SamplingParams(max_tokens=6, ignore_eos=True)
        engine.submit(
            GenerationRequest("Hi!", sampling=sampling, return_prompt_token_ids=True), sink
        )
        drain(engine)
        reported = [d.prompt_token_ids for d in sink.details if d and d.prompt_token_ids]
        assert reported == [(BOS, *b"Hi!")]
        plain = run(engine, "Hi!", max_tokens=2)
        assert all(d is None or d.prompt_token_ids is None for d in plain.details)

    def test_idle_cached_blocks_are_evicted_when_needed(self) -> None:
        engine = make_engine(kv_blocks=12, block_size=4)
        for i in range(10):
            sink = run(engine, f"distinct {i} " * 2, max_tokens=4, ignore_eos=True)
            assert sink.final is not None and sink.final[2] == "length"
        assert engine.pool.stats().used == 0

    def test_cancellation_storm_returns_every_block(self) -> None:
        rng = np.random.default_rng(7)
        engine = make_engine(kv_blocks=64, block_size=4)
        sinks = [
            submit(
                engine,
                "storm " * int(rng.integers(1, 8)),
                RecordingSink(cancel_after=int(rng.integers(0, 6))),
                max_tokens=int(rng.integers(1, 40)),
                ignore_eos=True,
            )
            for _ in range(40)
        ]
        drain(engine)
        assert all(s.done.is_set() for s in sinks)
        stats = engine.pool.stats()
        assert stats.used == 0 and stats.free + stats.cached_idle == stats.total

    def test_one_failing_sequence_does_not_stop_the_others(self) -> None:
        engine = make_engine()
        bad = BrokenSink()
        good = submit(engine, "fine", max_tokens=10, ignore_eos=True)
        submit(engine, "broken", bad, max_tokens=10, ignore_eos=True)
        drain(engine)
        assert "sink broke" in bad.error
        assert good.final is not None and good.tokens == 10
        assert engine.stats.finished["error"] == 1

    def test_the_engine_thread_serves_requests(self) -> None:
        engine = make_engine()
        engine.start()
        try:
            first = submit(engine, "threaded", max_tokens=5, ignore_eos=True)
            assert first.done.wait(30)
            # The loop is idle (or about to be) with nothing to run: a request wakes it.
            second = submit(engine, "again", max_tokens=3, ignore_eos=True)
            assert second.done.wait(30)
        finally:
            engine.stop()
        assert (first.tokens, second.tokens) == (5, 3)

    def test_an_idle_engine_sleeps_until_a_request_comes(self) -> None:
        engine = make_engine()
        waits: list[float | None] = []

        class OneWait(threading.Event):
            def wait(self, timeout: float | None = None) -> bool:
                waits.append(timeout)
                engine._stopping = True  # one idle wait is what is looked at
                return True

        engine._wake = OneWait()
        engine._loop()
        assert waits == [None]  # no timer: an idle engine takes no CPU


def auto_responses(tokens: int, running: int, word_ends: int) -> list[int]:
    """Tokens per streamed response before the last token (whose response depends on how
    many finish before it in that step) when the interval grows with the batch: after
    tokens 1, 3, 7, ..., then every running / 4, and with the token that ends the first
    word."""
    counts, unsent = [], 0
    for generated in range(1, tokens):
        unsent += 1
        interval = min(-(-running // 4), 1 << (generated.bit_length() - 1))
        if generated == word_ends or unsent >= interval:
            counts.append(unsent)
            unsent = 0
    return counts


class TestStreamInterval:
    def test_lone_stream_gets_every_token(self) -> None:
        sink = run(make_engine(), "alone", max_tokens=12, ignore_eos=True)
        assert [n for _, n in sink.deltas] == [1] * len(sink.deltas)

    def test_busy_engine_sends_fewer_larger_responses_first_tokens_sooner(self) -> None:
        engine = make_engine()
        sinks = [submit(engine, f"busy {i}", max_tokens=23, ignore_eos=True) for i in range(16)]
        drain(engine)
        for sink in sinks:
            # Time to first token is not traded away and the first words follow soon (a
            # response with the token that ends the first word); then, with 16 running,
            # one response per 4 tokens.
            expected = auto_responses(23, running=16, word_ends=first_word_tokens(sink))
            assert [n for _, n in sink.deltas][: len(expected)] == expected
            assert sink.tokens == 23 and len(sink.text) == 23
        assert any(first_word_tokens(s) not in (0, 1, 3, 7, 11, 15, 19) for s in sinks)

    def test_a_gap_between_responses_groups_a_fast_lone_streams_tokens(self) -> None:
        """stream_gap_ms 5 on an engine whose steps take 2 ms (its clock): the first token
        at once, then a response per 3 tokens; text held when its sequence pauses (a more
        urgent one's first tokens) still goes out once the gap has passed."""
        now = [0.0]
        engine = Engine(
            Transformer(SMALL, seed=0),
            config=EngineConfig(stream_gap_ms=5, urgent_first_tokens=3),
            clock=lambda: now[0],
        )
        low = submit_at(engine, "alone", 2, max_tokens=40, ignore_eos=True, seed=7)
        for _ in range(11):
            engine.step()
            now[0] += 0.002
        assert first_word_tokens(low) == 7  # the end of a response anyway
        assert [n for _, n in low.deltas] == [1, 3, 3, 3]  # the 11th token is held
        held = low.tokens_so_far()
        submit_at(engine, "urgent", 0, max_tokens=5, ignore_eos=True)
        engine.step()  # the urgent prompt's step: the low one pauses, its token held
        assert low.tokens_so_far() == held
        now[0] += 0.005
        engine.step()
        assert low.tokens_so_far() == held + 1  # sent though it computed nothing
        drain(engine)
        assert low.tokens == 40

    def test_a_requests_own_gap_replaces_the_models_after_its_first_responses(self) -> None:
        """stream_gap_ms 6 after 2 responses, asked by the request, on an engine whose
        own gap is 4 ms and whose steps take 2 ms: the first token at once, the next two
        4 ms later (the model's gap), then a response per 3 tokens."""
        now = [0.0]
        config = EngineConfig(stream_gap_ms=4)
        engine = Engine(Transformer(SMALL, seed=0), config=config, clock=lambda: now[0])
        sampling = SamplingParams(max_tokens=14, ignore_eos=True, seed=7)
        plain, gapped = RecordingSink(), RecordingSink()
        engine.submit(GenerationRequest("same", sampling=sampling), plain)
        asked = GenerationRequest("same", sampling=sampling, stream_gap=StreamGap(0.006, 2))
        engine.submit(asked, gapped)
        while engine.step():
            now[0] += 0.002
        assert [n for _, n in plain.deltas] == [1, 2, 2, 2, 2, 2, 2]  # the model's own
        # The 7th token ends the first word, which goes out at once, gap or not.
        assert first_word_tokens(gapped) == 7
        assert [n for _, n in gapped.deltas] == [1, 2, 3, 1, 3, 3]
        assert gapped.final is not None and gapped.final[1] == 1  # the last never waits
        assert gapped.text == plain.text

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("stream_gap_ms", -1),
            ("stream_gap_ms", 1001),
            ("stream_gap_ms", float("nan")),
            ("stream_gap_ms", "8"),
            ("stream_gap_ms", True),
            ("stream_gap_after", -1),
            ("stream_gap_after", 2.5),
            ("stream_gap_after", None),
        ],
    )
    def test_a_stream_gap_out_of_its_range_is_refused_by_name(self, name: str, value: Any) -> None:
        with pytest.raises(RequestError, match=name):
            parse_stream_gap({"stream_gap_ms": 8, name: value})

    def test_a_stream_gap_is_read_in_seconds_and_none_without_it(self) -> None:
        assert parse_stream_gap({}) is None and parse_stream_gap({"stream_gap_after": 2}) is None
        asked = {"stream_gap_ms": 8.0, "stream_gap_after": 3}
        assert parse_stream_gap(asked) == StreamGap(0.008, 3)

    def test_fixed_interval(self) -> None:
        sink = run(make_engine(stream_interval=5), "fixed", max_tokens=16, ignore_eos=True)
        assert [n for _, n in sink.deltas] == [1, 5, 5, 5]
        assert sink.final is not None and sink.final[1] == 0
