"""The reference engine's parts: tokenizer, contract parsing, sampler, stops, transformer, loop."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pytest
from refengine import (
    ByteTokenizer,
    Engine,
    EngineConfig,
    GenerationRequest,
    ModelShape,
    RequestError,
    SamplingParams,
    Transformer,
    rowstable,
)
from refengine.attention import Segment
from refengine.contract import (
    StreamGap,
    StructuredOutput,
    parse_cache_salt,
    parse_priority,
    parse_sampling_parameters,
    parse_stream_gap,
)
from refengine.kvcache import BlockPool
from refengine.quant import quantize
from refengine.rowstable import (
    CACHED_PLAN_ROWS,
    Block,
    Layout,
    LayoutBook,
    _candidates,
    _fastest,
    matmul,
    probe_layout,
)
from refengine.sampling import Sampler
from refengine.sequence import Details, TokenLogprob, logprob_entry
from refengine.stops import StopMatcher
from refengine.tokenizer import BOS, EOS
from refengine.transformer import _gelu

from bench.engine import model_parameters

SMALL = ModelShape(n_layers=2, d_model=64, n_heads=4, d_ff=128, max_context=256)


class TestTokenizer:
    def test_round_trip_with_multibyte_text(self) -> None:
        tok = ByteTokenizer()
        text = "héllo, wörld ✓"
        ids = tok.encode(text)
        assert ids[0] == BOS
        assert len(ids) == 1 + len(text.encode("utf-8"))
        assert tok.decode(ids) == text

    def test_stream_decoder_never_splits_a_character(self) -> None:
        decoder = ByteTokenizer().stream_decoder()
        pieces = [decoder.push(b) for b in "✓".encode()]
        assert pieces == ["", "", "✓"]
        assert decoder.push(EOS) == ""


class TestSamplingParameters:
    def test_defaults_follow_vllm(self) -> None:
        params = parse_sampling_parameters(None)
        assert params.max_tokens == 16
        assert params.temperature == 1.0
        assert params.top_p == 1.0

    def test_parses_every_supported_key(self) -> None:
        params = parse_sampling_parameters(
            b'{"max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 7,'
            b' "stop": "x", "ignore_eos": true}'
        )
        assert params == SamplingParams(5, 0.0, 0.5, 0, 7, ("x",), True)

    @pytest.mark.parametrize(
        ("raw", "field"),
        [
            (b'{"max_tokens": 0}', "max_tokens"),
            (b'{"max_tokens": "5"}', "max_tokens"),
            (b'{"temperature": -0.1}', "temperature"),
            (b'{"top_p": 0}', "top_p"),
            (b'{"top_p": 1.5}', "top_p"),
            (b'{"min_p": 1.5}', r"min_p: must be in \[0, 1\]"),
            (b'{"stop_token_ids": 5}', "stop_token_ids: must be a list"),
            (b'{"stop_token_ids": [1, -1]}', "stop_token_ids: each must be a token id"),
            (b'{"stop_token_ids": [true]}', "stop_token_ids: each must be a token id"),
            (b'{"allowed_token_ids": [1.5]}', "allowed_token_ids: each must be a token id"),
            (b'{"bad_words": "x"}', "bad_words: a list of at most 64"),
            (b'{"bad_words": ["ok", " "]}', "bad_words: each must be a word"),
            (b'{"min_p": -0.1}', "min_p: must be >= 0"),
            (b'{"min_p": "0.1"}', "min_p: must be a finite number"),
            (b'{"stop": [""]}', "stop"),
            (b'{"bogus": 1}', "unknown keys"),
            (b'{"presence_penalty": 2.5}', r"presence_penalty: must be in \[-2.0, 2.0\]"),
            (b'{"frequency_penalty": -2.01}', "frequency_penalty: must be in"),
            (b'{"frequency_penalty": "1"}', "frequency_penalty: must be a finite number"),
            (b'{"repetition_penalty": 0}', "repetition_penalty: must be > 0"),
            (b'{"logit_bias": [1]}', "logit_bias: must be an object"),
            (b'{"logit_bias": {"x": 1}}', "logit_bias: 'x' is not a token id"),
            (b'{"logit_bias": {"5": 100.5}}', r"logit_bias: must be in \[-100.0, 100.0\]"),
            (b'{"logit_bias": {"5": "1"}}', "logit_bias: must be a finite number"),
            # vLLM keys not implemented: refused unless they ask for nothing.
            (b'{"n": 2}', "n: 2 is not supported"),
            (
                b'{"min_tokens": 5, "max_tokens": 4}',
                r"min_tokens: must be at most max_tokens \(4\)",
            ),
            (b'{"min_tokens": -1}', "min_tokens: must be >= 0"),
            (b'{"n": true}', "n: True is not supported"),
            (b"[1]", "JSON object"),
            (b"{", "not valid JSON"),
            (b"\xff", "UTF-8"),
        ],
    )
    def test_rejects_bad_values_naming_the_field(self, raw: bytes, field: str) -> None:
        with pytest.raises(RequestError, match=field):
            parse_sampling_parameters(raw)

    def test_parses_the_penalties(self) -> None:
        raw = b'{"presence_penalty": -1, "frequency_penalty": 0.5, "repetition_penalty": 1.2}'
        params = parse_sampling_parameters(raw)
        assert (params.presence_penalty, params.frequency_penalty) == (-1.0, 0.5)
        assert params.repetition_penalty == 1.2 and params.penalized
        assert not parse_sampling_parameters(None).penalized

    def test_vllm_keys_that_ask_for_nothing_are_accepted(self) -> None:
        raw = b'{"n": 1, "best_of": null, "min_tokens": 0, "skip_special_tokens": true}'
        assert parse_sampling_parameters(raw) == parse_sampling_parameters(None)


class TestSampler:
    def test_greedy_picks_the_best_allowed_token(self) -> None:
        logits = np.zeros(258, dtype=np.float32)
        logits[7] = 100.0  # not printable: masked out
        logits[ord("q")] = 5.0
        assert Sampler(SamplingParams(temperature=0.0)).sample(logits) == ord("q")

    def test_output_is_restricted_to_printable_text(self) -> None:
        rng = np.random.default_rng(0)
        sampler = Sampler(SamplingParams(seed=1, ignore_eos=True))
        tokens = {sampler.sample(rng.normal(size=258).astype(np.float32)) for _ in range(500)}
        assert all(t == 10 or 32 <= t < 127 for t in tokens)

    def test_same_seed_same_tokens(self) -> None:
        logits = np.random.default_rng(1).normal(size=258).astype(np.float32)
        first = [Sampler(SamplingParams(seed=3)).sample(logits) for _ in range(5)]
        a, b = Sampler(SamplingParams(seed=3)), Sampler(SamplingParams(seed=3))
        assert [a.sample(logits) for _ in range(20)] == [b.sample(logits) for _ in range(20)]
        assert len(set(first)) == 1

    def test_top_k_one_is_greedy(self) -> None:
        logits = np.random.default_rng(2).normal(size=258).astype(np.float32)
        greedy = Sampler(SamplingParams(temperature=0.0)).sample(logits)
        sampler = Sampler(SamplingParams(top_k=1, seed=0))
        assert {sampler.sample(logits) for _ in range(20)} == {greedy}

    def test_tiny_top_p_keeps_only_the_most_likely(self) -> None:
        logits = np.random.default_rng(3).normal(size=258).astype(np.float32)
        greedy = Sampler(SamplingParams(temperature=0.0)).sample(logits)
        sampler = Sampler(SamplingParams(top_p=1e-6, seed=0))
        assert {sampler.sample(logits) for _ in range(20)} == {greedy}

    def test_min_p_draws_only_tokens_near_the_likeliest(self) -> None:
        """vLLM's min_p: with 0.5, tokens at least half as likely as the likeliest are
        drawn (all of them, in time), none less likely; with 1, only the likeliest."""
        logits = np.full(258, -30.0, dtype=np.float32)
        likely = {ord("a"): 0.0, ord("b"): np.log(0.6), ord("c"): np.log(0.4)}
        for token, logit in likely.items():
            logits[token] = logit
        sampler = Sampler(SamplingParams(min_p=0.5, seed=0))
        drawn = {sampler.sample(logits) for _ in range(200)}
        assert drawn == {ord("a"), ord("b")}
        plain = Sampler(SamplingParams(seed=0))
        assert ord("c") in {plain.sample(logits) for _ in range(200)}
        only = Sampler(SamplingParams(min_p=1.0, seed=0))
        assert {only.sample(logits) for _ in range(20)} == {ord("a")}
        assert parse_sampling_parameters(b'{"min_p": 0.05}').min_p == 0.05

    def test_eos_allowed_unless_ignored(self) -> None:
        logits = np.full(258, -50.0, dtype=np.float32)
        logits[EOS] = 50.0
        assert Sampler(SamplingParams(temperature=0.0)).sample(logits) == EOS
        assert Sampler(SamplingParams(temperature=0.0, ignore_eos=True)).sample(logits) != EOS


class TestPenalties:
    def test_frequency_counts_each_occurrence_and_presence_once(self) -> None:
        logits = np.zeros(258, dtype=np.float32)
        logits[ord("a")], logits[ord("b")], logits[ord("c")] = 3.0, 2.2, 1.5
        frequency = Sampler(SamplingParams(temperature=0.0, frequency_penalty=1.0))
        # a (3 -> 2), b (2.2 -> 1.2), a again (2 -> 1), then c (1.5) beats both
        assert [frequency.sample(logits) for _ in range(4)] == [ord(x) for x in "abac"]
        presence = Sampler(SamplingParams(temperature=0.0, presence_penalty=1.0))
        # presence takes 1 off a token once, however often it comes: a stays at 2
        assert [presence.sample(logits) for _ in range(4)] == [ord(x) for x in "abaa"]

    def test_repetition_divides_positive_and_multiplies_negative_logits(self) -> None:
        logits = np.full(258, -5.0, dtype=np.float32)
        logits[ord("p")], logits[ord("q")] = 4.0, 2.5  # "p" in the prompt: 4 / 2 = 2 < 2.5
        logits[ord("n")], logits[ord("m")] = -0.2, -0.3  # "n" in the prompt: -0.4 < -0.3
        params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
        assert Sampler(params, prompt=(ord("p"), ord("n"))).sample(logits) == ord("q")
        logits[ord("q")] = -9.0
        logits[ord("p")] = -9.0
        assert Sampler(params, prompt=(ord("n"),)).sample(logits) == ord("m")
        assert Sampler(SamplingParams(temperature=0.0)).sample(logits) == ord("n")

    def test_a_logit_bias_moves_a_token_but_never_past_the_output_mask(self) -> None:
        logits = np.zeros(258, dtype=np.float32)
        logits[ord("a")] = 3.0
        params = SamplingParams(temperature=0.0, logit_bias=((ord("z"), 3.5), (7, 100.0)))
        assert Sampler(params).sample(logits) == ord("z")  # 7 is not printable: masked
        down = SamplingParams(seed=0, logit_bias=tuple((t, -100.0) for t in range(32, 127)))
        sampler = Sampler(down)
        assert {sampler.sample(logits) for _ in range(50)} <= {10, EOS}
        # the engine's shared masks are left as they were
        assert Sampler(SamplingParams(temperature=0.0)).sample(logits) == ord("a")

    def test_min_tokens_hold_off_the_end_then_let_it_come(self) -> None:
        logits = np.full(258, -50.0, dtype=np.float32)
        logits[EOS], logits[ord("x")] = 50.0, 0.0
        sampler = Sampler(SamplingParams(temperature=0.0, min_tokens=3))
        assert [sampler.sample(logits) for _ in range(4)] == [ord("x")] * 3 + [EOS]

    def test_stop_strings_count_only_past_min_tokens(self) -> None:
        kw: dict[str, Any] = {"max_tokens": 40, "temperature": 0.0}
        free = run(make_engine(), "stops", ignore_eos=True, **kw).text
        stop = free[2:4]  # a stop string that ends at the 4th token
        stopped = run(make_engine(), "stops", stop=[stop], ignore_eos=True, **kw).text
        assert stopped == free[: free.index(stop)]
        later = run(make_engine(), "stops", stop=[stop], min_tokens=4, ignore_eos=True, **kw)
        rest = free[4:]
        expected = free[: 4 + rest.index(stop)] if stop in rest else free
        assert later.text == expected and len(later.text) > len(stopped)
        # One begun in the first min_tokens and ended after them counts (vLLM looks back).
        across = run(make_engine(), "stops", stop=[free[3:5]], min_tokens=4, ignore_eos=True, **kw)
        assert across.text == free[:3]

    def test_a_seeded_stream_resumed_elsewhere_draws_what_it_would_have(self) -> None:
        kw: dict[str, Any] = {"temperature": 1.0, "seed": 7, "ignore_eos": True}
        whole = run(make_engine(), "seeded", max_tokens=30, **kw).text
        head = whole[:12]
        sink = RecordingSink()
        request = GenerationRequest(
            "seeded" + head,
            sampling=SamplingParams(max_tokens=30 - len(head), **kw),
            resumed_output_chars=len(head),
        )
        engine = make_engine()
        engine.submit(request, sink)
        drain(engine)
        assert len(whole) == 30 and head + sink.text == whole

    def test_an_engine_refuses_a_bias_on_a_token_it_lacks(self) -> None:
        engine = make_engine()
        request = GenerationRequest("x", sampling=SamplingParams(logit_bias=((258, 1.0),)))
        with pytest.raises(RequestError, match=r"logit_bias: 258 is not a token \(0-257\)"):
            engine.submit(request, RecordingSink())

    def test_output_before_a_resume_counts_as_output(self) -> None:
        logits = np.zeros(258, dtype=np.float32)
        logits[ord("a")], logits[ord("b")] = 3.0, 2.5
        params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
        resumed = Sampler(params, prompt=(BOS, ord("a")), output=(ord("a"),))
        assert resumed.sample(logits) == ord("b")
        assert Sampler(params, prompt=(BOS, ord("a"))).sample(logits) == ord("a")

    def test_penalties_change_a_generation_and_keep_it_reproducible_in_a_batch(self) -> None:
        kw: dict[str, Any] = {"max_tokens": 60, "temperature": 0.0, "ignore_eos": True}
        plain = run(make_engine(), "loop", **kw).text
        penalized = run(make_engine(), "loop", frequency_penalty=2.0, **kw).text
        assert penalized != plain
        # the random model repeats itself greedily; the penalty spreads its output out
        assert len(set(penalized)) > len(set(plain))
        engine = make_engine()
        others = [submit(engine, f"other {i}", max_tokens=50, seed=i) for i in range(4)]
        mine = submit(engine, "loop", frequency_penalty=2.0, **kw)
        drain(engine)
        assert mine.text == penalized and all(o.final is not None for o in others)

    def test_a_resumed_generation_counts_what_it_sent_before(self) -> None:
        kw: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True, "frequency_penalty": 2.0}
        whole = run(make_engine(), "loop", max_tokens=40, **kw).text
        head = whole[:20]

        def resume(chars: int) -> str:
            sink = RecordingSink()
            request = GenerationRequest(
                "loop" + head,
                sampling=SamplingParams(max_tokens=20, **kw),
                resumed_output_chars=chars,
            )
            engine = make_engine()
            engine.submit(request, sink)
            drain(engine)
            return sink.text

        assert head + resume(len(head)) == whole
        assert head + resume(0) != whole  # without it, the penalty forgets the first part


class TestStructuredOutputs:
    SCHEMA: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "tag": {"enum": ["x", "y"]}},
        "required": ["n", "tag"],
        "additionalProperties": False,
    }

    def structured(self, kind: str, spec: str = "", **kw: Any) -> RecordingSink:
        params = {"max_tokens": 200, "seed": 3, **kw}
        return run(make_engine(), "answer:", structured=StructuredOutput(kind, spec), **params)

    def test_the_output_is_an_instance_of_the_schema_and_then_ends(self) -> None:
        for seed in range(3):
            sink = self.structured("json", json.dumps(self.SCHEMA), seed=seed)
            value = json.loads(sink.text)
            assert set(value) == {"n", "tag"} and isinstance(value["n"], int)
            assert value["tag"] in ("x", "y")
            assert sink.final is not None and sink.final[2] == "stop"

    def test_a_json_object_a_pattern_and_a_choice(self) -> None:
        assert isinstance(json.loads(self.structured("json_object", max_tokens=400).text), dict)
        code = self.structured("regex", "[0-9]{3}-[a-z]{2,4}").text
        assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", code), code
        picked = self.structured("choice", json.dumps(["yes", "no", "a.b"]), temperature=0.0)
        assert picked.text in ("yes", "no", "a.b")

    def test_ignore_eos_still_ends_with_the_grammar(self) -> None:
        sink = self.structured("regex", "[a-c]{4}", ignore_eos=True)
        assert re.fullmatch("[a-c]{4}", sink.text) and sink.tokens == 4

    @pytest.mark.parametrize(
        ("raw", "message"),
        [
            (b'{"structured_outputs": {"json": "{"}}', "structured_outputs.json: not valid JSON"),
            (b'{"structured_outputs": {"json": [1]}}', "must be a JSON schema"),
            (b'{"structured_outputs": {"regex": "a", "json_object": true}}', "exactly one"),
            (b'{"structured_outputs": {"choice": []}}', "choice: must be a list"),
            (b'{"structured_outputs": {"grammar": "x"}}', "exactly one"),
        ],
    )
    def test_a_bad_structure_is_refused_naming_it(self, raw: bytes, message: str) -> None:
        with pytest.raises(RequestError, match=message):
            parse_sampling_parameters(raw)

    def test_a_schema_that_does_not_compile_is_refused_at_submit(self) -> None:
        bad = StructuredOutput("json", json.dumps({"type": "nonsense"}))
        request = GenerationRequest("x", sampling=SamplingParams(structured=bad))
        with pytest.raises(RequestError, match=r"structured_outputs: .*nonsense"):
            make_engine().submit(request, RecordingSink())

    def test_a_resumed_structured_output_continues_its_grammar(self) -> None:
        whole = self.structured("json", json.dumps(self.SCHEMA), temperature=0.0).text
        head = whole[:6]
        sink = RecordingSink()
        request = GenerationRequest(
            "answer:" + head,
            sampling=SamplingParams(
                max_tokens=200,
                temperature=0.0,
                structured=StructuredOutput("json", json.dumps(self.SCHEMA)),
            ),
            resumed_output_chars=len(head),
        )
        engine = make_engine()
        engine.submit(request, sink)
        drain(engine)
        assert head + sink.text == whole


class TestStopMatcher:
    def test_match_split_across_pushes_is_cut_and_never_released(self) -> None:
        stops = StopMatcher(("END",))
        released = stops.push("abc E") + stops.push("N") + stops.push("Dxyz")
        assert released == "abc "
        assert stops.stopped

    def test_releases_text_that_cannot_start_a_stop(self) -> None:
        stops = StopMatcher(("END",))
        assert stops.push("hello E") == "hello "
        assert stops.push("X") == "EX"
        assert not stops.stopped

    def test_a_stop_begun_before_matching_and_ended_after_it_is_cut(self) -> None:
        stops = StopMatcher(("END",))
        assert stops.push("abc EN", matching=False) == "abc "  # held: it may become END
        assert stops.push("D more") == ""
        assert stops.stopped

    def test_a_stop_wholly_before_matching_is_released(self) -> None:
        stops = StopMatcher(("END", "ab"))
        assert stops.push("xENDya", matching=False) == "xENDy"
        assert stops.push("c") == "ac"
        assert not stops.stopped

    def test_the_stop_that_begins_first_is_kept_when_asked(self) -> None:
        stops = StopMatcher(("CD", "BC", "B"), include=True)
        assert stops.push("aBCD") == "aBC" and stops.stopped

    def test_flush_releases_a_held_partial_match(self) -> None:
        stops = StopMatcher(("END",))
        assert stops.push("xEN") == "x"
        assert stops.flush() == "EN"


def _segment(pool: BlockPool, table: list[int], tokens: list[int], start: int) -> Segment:
    return Segment(tokens, start, table[: -(-(start + len(tokens)) // pool.block_size)])


class TestTransformer:
    def test_incremental_decode_matches_a_full_forward_pass(self) -> None:
        model = Transformer(SMALL, seed=0)
        tokens = ByteTokenizer().encode("the kv cache must agree")
        pool = BlockPool(8, 4, SMALL.n_layers, SMALL.n_heads, SMALL.head_dim)
        table = [5, 2, 7, 0, 3, 1, 6]  # blocks need not be contiguous
        full = model.forward([_segment(pool, table, tokens, 0)], pool)[0]
        model.forward([_segment(pool, table, tokens[:10], 0)], pool)
        for position in range(10, len(tokens) - 1):
            model.forward([_segment(pool, table, tokens[position : position + 1], position)], pool)
        last = len(tokens) - 1
        incremental = model.forward([_segment(pool, table, tokens[last:], last)], pool)[0]
        np.testing.assert_allclose(incremental, full, rtol=1e-4, atol=1e-4)

    def test_a_sequence_computes_the_same_alone_or_in_a_batch(self) -> None:
        model = Transformer(SMALL, seed=0)
        pool = BlockPool(16, 4, SMALL.n_layers, SMALL.n_heads, SMALL.head_dim)
        mine = ByteTokenizer().encode("same numbers")
        alone = model.forward([_segment(pool, [0, 1, 2, 3], mine, 0)], pool)[0]
        others = [_segment(pool, [8 + i], ByteTokenizer().encode("ab"), 0) for i in range(3)]
        batched = model.forward([*others, _segment(pool, [4, 5, 6, 7], mine, 0)], pool)[-1]
        assert np.array_equal(alone, batched)

    def test_decoding_with_same_length_neighbours_is_exact(self) -> None:
        model = Transformer(SMALL, seed=0)
        pool = BlockPool(32, 4, SMALL.n_layers, SMALL.n_heads, SMALL.head_dim)
        prompts = [ByteTokenizer().encode(f"seq {i}!") for i in range(4)]  # equal lengths
        tables = [[4 * i, 4 * i + 1, 4 * i + 2] for i in range(4)]
        for prompt, table in zip(prompts, tables, strict=True):
            model.forward([_segment(pool, table, prompt[:-1], 0)], pool)
        last = len(prompts[0]) - 1
        batched = model.forward(
            [_segment(pool, t, p[last:], last) for p, t in zip(prompts, tables, strict=True)],
            pool,
        )
        for i, (prompt, table) in enumerate(zip(prompts, tables, strict=True)):
            alone = model.forward([_segment(pool, table, prompt[last:], last)], pool)[0]
            assert np.array_equal(alone, batched[i])

    def test_decode_reading_last_steps_keys_matches_a_fresh_gather(self) -> None:
        model = Transformer(SMALL, seed=0)
        pool = BlockPool(16, 4, SMALL.n_layers, SMALL.n_heads, SMALL.head_dim)
        tokens = ByteTokenizer().encode("one token per step, blocks kept")
        tables = [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
        other = [_segment(pool, tables[1], tokens[:3], 0)]
        model.forward([_segment(pool, tables[0], tokens[:5], 0)], pool)
        kept, fresh = [], []
        for position in range(5, len(tokens)):
            step = [_segment(pool, tables[0], tokens[position : position + 1], position)]
            kept.append(model.forward(step, pool)[0])  # reads the last step's copy
            model.forward(other, pool)  # another step in between: the next read gathers
            fresh.append(model.forward(step, pool)[0])
        assert np.array_equal(np.array(kept), np.array(fresh))

    def test_a_block_handed_out_again_is_read_afresh(self) -> None:
        model = Transformer(SMALL, seed=0)
        pool = BlockPool(2, 4, SMALL.n_layers, SMALL.n_heads, SMALL.head_dim)
        table = [pool.allocate(), pool.allocate()]
        tokens = ByteTokenizer().encode("abcdef")
        model.forward([_segment(pool, table, tokens[:5], 0)], pool)
        pool.release(table)
        table = [pool.allocate(), pool.allocate()][::-1]  # the same blocks, new owners
        pool.kv[:] = 0.0  # their contents changed with no step in between
        reread = model.forward([_segment(pool, table, tokens[5:], 5)], pool)[0]
        pool.kv[:] = 0.0
        gathered = Transformer(SMALL, seed=0).forward([_segment(pool, table, tokens[5:], 5)], pool)
        assert np.array_equal(reread, gathered[0])

    def test_weights_depend_on_the_seed(self) -> None:
        tokens = ByteTokenizer().encode("hi")
        pool = BlockPool(1, 4, SMALL.n_layers, SMALL.n_heads, SMALL.head_dim)
        a = Transformer(SMALL, seed=0).forward([_segment(pool, [0], tokens, 0)], pool)
        b = Transformer(SMALL, seed=1).forward([_segment(pool, [0], tokens, 0)], pool)
        assert not np.allclose(a, b)

    def test_gelu_is_the_tanh_approximation_and_quiet_at_the_extremes(self) -> None:
        x = np.concatenate([np.linspace(-12, 12, 2001), [-1e4, -100.0, 0.0, 100.0, 1e4]])
        x32 = x.astype(np.float32)
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            got = _gelu(x32.copy())
        want = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert got.dtype == np.float32

    def test_context_overflow_is_refused(self) -> None:
        model = Transformer(SMALL, seed=0)
        pool = BlockPool(80, 4, SMALL.n_layers, SMALL.n_heads, SMALL.head_dim)
        with pytest.raises(ValueError, match="context"):
            model.forward([_segment(pool, list(range(70)), [1] * 260, 0)], pool)


@pytest.fixture(scope="module")
def weights() -> tuple[Any, Any]:
    """A matrix of the default model's shape, and its probed layout."""
    w = np.random.default_rng(3).normal(size=(192, 576)).astype(np.float32) / 14
    return w, probe_layout(w)


class TestRowStableMatmul:
    @pytest.mark.parametrize("rows", [1, 2, 7, 15, 16, 17, 33, 129, 300])
    def test_every_row_computes_as_it_does_alone(self, weights: Any, rows: int) -> None:
        w, layout = weights
        rng = np.random.default_rng(rows)
        a = (rng.normal(size=(rows, 192)) * rng.uniform(0.01, 100, size=(rows, 1))).astype(
            np.float32
        )
        batched = matmul(a, w, layout)
        np.testing.assert_allclose(batched, a @ w, rtol=1e-4, atol=1e-3)
        for i in range(rows):
            assert np.array_equal(batched[i], matmul(a[i : i + 1], w, layout)[0])

    @pytest.mark.parametrize("rows", [1, 16, 129, 2064])
    def test_plan_places_each_row_once_at_alike_positions(self, weights: Any, rows: int) -> None:
        _, layout = weights
        placed = 0
        for block, numbers, positions in layout.plan(rows):
            assert set(positions.tolist()) <= set(block.slots)
            assert len(set(zip(numbers.tolist(), positions.tolist(), strict=True))) == len(numbers)
            placed += len(numbers)
        assert placed == rows

    def test_a_book_without_batch_invariance_multiplies_plainly(self, weights: Any) -> None:
        w, _ = weights
        assert LayoutBook(None, batch_invariant=False).layout(w) is None
        a = np.random.default_rng(5).normal(size=(3, 192)).astype(np.float32)
        assert np.array_equal(matmul(a, w, None), a @ w)

    def test_the_kept_layout_is_least_slower_than_the_best_at_its_worst_size(
        self, weights: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Timed at one row and at a batch (seconds faked per block height): the fastest
        at one row loses 2.5x at the batch, the fastest at the batch 5x at one row; the
        one 2x slower at one row and best at the batch is kept."""
        w, layout = weights
        assert layout in _candidates(w)
        fake = {1: (1.0, 10.0), 2: (2.0, 4.0), 4: (5.0, 4.0)}  # height -> (1 row, batch)

        def seconds(a: Any, w: Any, candidate: Layout) -> float:
            one, batch = fake[candidate.blocks[0].height]
            return one if len(a) == 1 else batch

        monkeypatch.setattr(rowstable, "_seconds", seconds)
        candidates = [Layout(False, (Block(h, tuple(range(h))),)) for h in fake]
        assert _fastest(candidates, w).blocks[0].height == 2

    def test_only_decode_sized_plans_are_kept(self, weights: Any) -> None:
        _, layout = weights
        small, large = CACHED_PLAN_ROWS, CACHED_PLAN_ROWS + 1
        assert layout.plan(small) is layout.plan(small)
        assert layout.plan(large) is not layout.plan(large)


class TestParameters:
    def test_config_pbtxt_parameters_build_the_shape_and_engine(self) -> None:
        params = model_parameters()
        shape, config = ModelShape.from_parameters(params), EngineConfig.from_parameters(params)
        assert (shape.n_layers, shape.d_model, shape.n_heads, shape.d_ff) == (
            int(params["n_layers"]),
            int(params["d_model"]),
            int(params["n_heads"]),
            int(params["d_ff"]),
        )
        assert shape.max_context == int(params["max_context"])
        assert (config.kv_blocks, config.block_size) == (
            int(params["kv_blocks"]),
            int(params["kv_block_size"]),
        )
        assert (config.max_running, config.max_batched_tokens, config.stream_interval) == (
            int(params["max_running"]),
            int(params["max_batched_tokens"]),
            int(params["stream_interval"]),
        )

    def test_absent_parameters_keep_their_defaults(self) -> None:
        config = EngineConfig.from_parameters({"kv_block_size": "8"})
        assert config == EngineConfig(block_size=8)
        assert ModelShape.from_parameters({"d_model": "64"}) == ModelShape(d_model=64)


@dataclass
class RecordingSink:
    cancel_after: int | None = None
    deltas: list[tuple[str, int]] = field(default_factory=list)
    final: tuple[str, int, str] | None = None
    details: list[Details | None] = field(default_factory=list)  # per response
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.deltas) >= self.cancel_after

    def emit(self, text: str, num_tokens: int, details: Details | None = None) -> None:
        self.deltas.append((text, num_tokens))
        self.details.append(details)

    def finish(
        self, text: str, num_tokens: int, reason: str, details: Details | None = None
    ) -> None:
        self.final = (text, num_tokens, reason)
        self.details.append(details)
        self.done.set()

    def fail(self, message: str) -> None:
        self.error = message
        self.done.set()

    @property
    def text(self) -> str:
        assert self.final is not None
        return "".join(t for t, _ in self.deltas) + self.final[0]

    @property
    def tokens(self) -> int:
        assert self.final is not None
        return sum(n for _, n in self.deltas) + self.final[1]

    def tokens_so_far(self) -> int:
        return sum(n for _, n in self.deltas) + (self.final[1] if self.final else 0)


class BrokenSink(RecordingSink):
    def emit(self, text: str, num_tokens: int, details: Details | None = None) -> None:
        raise RuntimeError("sink broke")


def make_engine(**config: int) -> Engine:
    return Engine(Transformer(SMALL, seed=0), config=EngineConfig(**config))


def submit(
    engine: Engine, prompt: str, sink: RecordingSink | None = None, **kw: Any
) -> RecordingSink:
    sink = sink or RecordingSink()
    stream = bool(kw.pop("stream", True))
    engine.submit(GenerationRequest(prompt, stream=stream, sampling=SamplingParams(**kw)), sink)
    return sink


def drain(engine: Engine, max_steps: int = 10_000) -> int:
    """Steps the engine until it has nothing to do; returns the steps taken."""
    for steps in range(max_steps):
        if not engine.step():
            return steps
    raise AssertionError("the engine did not become idle")


def run(engine: Engine, prompt: str, **kw: Any) -> RecordingSink:
    sink = submit(engine, prompt, **kw)
    drain(engine)
    assert sink.done.is_set()
    return sink


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


class TestLogprobs:
    def test_logprobs_above_the_engines_maximum_are_refused_naming_the_field(self) -> None:
        with pytest.raises(RequestError, match=r"sampling_parameters\.logprobs: at most 20"):
            submit(make_engine(), "hi", logprobs=21)
        for raw in (b'{"logprobs": true}', b'{"logprobs": -1}'):
            with pytest.raises(RequestError, match="logprobs"):
                parse_sampling_parameters(raw)

    def test_a_request_that_asks_for_nothing_gets_nothing_and_pays_nothing(self) -> None:
        sink = run(make_engine(), "hi", max_tokens=5, seed=1, ignore_eos=True)
        assert sink.details == [None] * len(sink.details)

    def test_each_response_carries_the_logprobs_of_its_own_tokens(self) -> None:
        engine = make_engine(stream_interval=2)
        request = GenerationRequest(
            "hi",
            sampling=SamplingParams(max_tokens=7, seed=3, ignore_eos=True, logprobs=2),
            return_logprobs=True,
            return_cumulative_logprob=True,
        )
        sink = RecordingSink()
        engine.submit(request, sink)
        drain(engine)
        counts = [n for _, n in sink.deltas] + [sink.final[1] if sink.final else 0]
        per_response = [len(d.logprobs or ()) if d else 0 for d in sink.details]
        assert per_response == counts and sum(counts) == 7
        tokens = [t for d in sink.details if d for t in d.logprobs or ()]
        assert all(len(t.top) == 2 and t.top[0][2] >= t.top[1][2] for t in tokens)
        last = sink.details[-1]
        assert last is not None and last.cumulative_logprob == pytest.approx(
            sum(t.logprob for t in tokens)
        )

    def test_responses_merged_while_waiting_keep_every_tokens_logprobs(self) -> None:
        first = Details((TokenLogprob(1, "a", -0.5, 1),), -0.5)
        later = Details((TokenLogprob(2, "b", -1.0, 2),), -1.5)
        merged = first.then(later)
        assert [t.token for t in merged.logprobs or ()] == [1, 2]
        assert merged.cumulative_logprob == -1.5


class TestPromptIds:
    def test_ids_are_read_as_given_without_a_bos_added(self) -> None:
        """The text's own tokens (BOS included) give the text's output; the same without
        the BOS are another prompt, as vLLM reads ids."""
        engine = make_engine()
        sampling = SamplingParams(max_tokens=8, seed=5, ignore_eos=True)
        ids = tuple(ByteTokenizer().encode("once upon"))
        outputs = []
        for request in (
            GenerationRequest("once upon", sampling=sampling),
            GenerationRequest("once upon", prompt_ids=ids, sampling=sampling),
            GenerationRequest("once upon", prompt_ids=ids[1:], sampling=sampling),
        ):
            sink = RecordingSink()
            engine.submit(request, sink)
            drain(engine)
            outputs.append(sink.text)
        assert outputs[0] == outputs[1] != outputs[2]

    def test_an_id_the_model_does_not_have_is_refused_naming_it(self) -> None:
        request = GenerationRequest("x", prompt_ids=(104, 258))
        with pytest.raises(RequestError, match=r"input_ids\[1\]: 258 is not a token \(0-257\)"):
            make_engine().submit(request, RecordingSink())


def prompt_scores(sink: RecordingSink) -> list[tuple[TokenLogprob, ...]]:
    return [d.prompt_logprobs for d in sink.details if d and d.prompt_logprobs is not None]


def teacher_forced(text: str) -> list[float]:
    """The log probability of each of the text's tokens after what precedes it (BOS
    first), from one forward pass of the same weights over the whole prompt."""
    model, tokens = Transformer(SMALL, seed=0), ByteTokenizer().encode(text)
    pool = BlockPool(64, 4, SMALL.n_layers, SMALL.n_heads, SMALL.head_dim)
    table = list(range(-(-len(tokens) // 4)))
    rows = model.forward([Segment(tokens, 0, table)], pool, np.arange(len(tokens)))
    logs = rows - np.log(np.exp(rows - rows.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True))
    logs -= rows.max(axis=1, keepdims=True)
    return [float(logs[i - 1, tokens[i]]) for i in range(1, len(tokens))]


class TestPromptLogprobs:
    TEXT = "prompt log probabilities, scored over several chunks"

    def test_each_prompt_token_is_scored_after_what_precedes_it_once_on_the_first_response(
        self,
    ) -> None:
        """Chunked over several steps, and with the prompt already in the prefix cache
        (which has no logits: it is computed whole, and reported as not cached)."""
        engine = make_engine(block_size=4, max_batched_tokens=8, stream_interval=1)
        run(engine, self.TEXT, max_tokens=2)  # now cached
        request = GenerationRequest(
            self.TEXT,
            sampling=SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3),
            return_num_cached_tokens=True,
        )
        sink = RecordingSink()
        engine.submit(request, sink)
        drain(engine)
        (scores,) = prompt_scores(sink)
        assert sink.details[0] is not None and sink.details[0].prompt_logprobs == scores
        assert sink.details[0].num_cached_tokens == 0
        assert [t.token for t in scores] == list(self.TEXT.encode())  # BOS is not the text's
        assert [t.logprob for t in scores] == pytest.approx(teacher_forced(self.TEXT), abs=1e-4)
        for t in scores:
            assert len(t.top) == 3 and t.top[0][2] >= t.top[1][2] >= t.top[2][2]
            assert t.rank == 1 + sum(lp > t.logprob + 1e-9 for _, _, lp in t.top) or t.rank > 3
        assert engine.pool.stats().used == 0

    def test_a_preemption_mid_prompt_neither_loses_nor_repeats_a_position(self) -> None:
        engine = make_engine(block_size=4, max_batched_tokens=8, max_running=1)
        low = RecordingSink()
        sampling = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0)
        engine.submit(GenerationRequest(self.TEXT, sampling=sampling, priority=2), low)
        engine.step()
        engine.step()  # two chunks of its prompt scored
        submit_at(engine, "urgent", 0, max_tokens=2, ignore_eos=True)
        drain(engine)
        assert engine.stats.preemptions_by_priority == {2: 1}
        (scores,) = prompt_scores(low)
        assert [t.logprob for t in scores] == pytest.approx(teacher_forced(self.TEXT), abs=1e-4)
        assert all(t.top == () for t in scores)

    def test_without_a_bos_the_first_token_has_no_log_probability(self) -> None:
        """The entry of the prompt's first token when nothing precedes it: rank 0, and
        null in the backend's JSON."""
        first = TokenLogprob(104, "h", 0.0, 0)
        assert logprob_entry(first) == {
            "104": {"logprob": None, "rank": None, "decoded_token": "h"}
        }

    def test_more_entries_than_one_response_should_carry_are_refused_naming_the_field(
        self,
    ) -> None:
        engine = make_engine(max_prompt_logprob_entries=40)
        run(engine, "x" * 19, max_tokens=1, prompt_logprobs=1)  # 20 tokens x 2: 40
        with pytest.raises(RequestError, match=r"sampling_parameters\.prompt_logprobs: 20 prompt"):
            submit(engine, "x" * 19, prompt_logprobs=2)

    def test_prompt_logprobs_above_the_engines_maximum_are_refused_naming_the_field(
        self,
    ) -> None:
        with pytest.raises(RequestError, match=r"sampling_parameters\.prompt_logprobs: at most"):
            submit(make_engine(), "hi", prompt_logprobs=21)
        assert parse_sampling_parameters(b'{"prompt_logprobs": 2}').prompt_logprobs == 2
        with pytest.raises(RequestError, match="prompt_logprobs"):
            parse_sampling_parameters(b'{"prompt_logprobs": -1}')


class TestQuantizedWeights:
    @pytest.mark.parametrize("kind", ["int8", "q4"])
    def test_a_quantized_matrix_expands_close_to_its_values(self, kind: str) -> None:
        matrix = np.random.default_rng(0).normal(size=(64, 48)).astype(np.float32)
        weight = quantize(matrix, kind)
        expanded = weight.expand()
        assert expanded.shape == matrix.shape == weight.shape
        if kind == "int8":
            step = np.abs(matrix).max(axis=0) / 127  # per output channel
            assert (np.abs(expanded - matrix) <= step / 2 + 1e-6).all()
        else:
            # Per group of 32 rows, 16 levels from its minimum to its maximum: at most half
            # a step off (and the float16 rounding of scale and minimum).
            groups = matrix.reshape(2, 32, 48)
            step = (groups.max(axis=1) - groups.min(axis=1)) / 15
            error = np.abs(expanded - matrix).reshape(2, 32, 48)
            assert (error <= step[:, None, :] * 0.51 + 2e-3).all()
        ids = np.array([3, 0, 47])
        assert np.array_equal(weight.columns(ids), expanded[:, ids])
        assert weight.nbytes < matrix.nbytes / (3 if kind == "int8" else 5)

    def test_q4_keeps_weights_already_on_a_4_bit_grid(self) -> None:
        """Values m + d * q per group of 32 (a Q4_1 file's weights, expanded) come back."""
        rng = np.random.default_rng(1)
        d = rng.uniform(0.01, 0.1, size=(2, 1, 8)).astype(np.float16).astype(np.float32)
        m = rng.uniform(-1, 0, size=(2, 1, 8)).astype(np.float16).astype(np.float32)
        q = rng.integers(0, 16, size=(2, 32, 8))
        q[:, 0], q[:, 1] = 0, 15  # each group spans its whole grid
        matrix = (m + d * q).astype(np.float32).reshape(64, 8)
        np.testing.assert_allclose(quantize(matrix, "q4").expand(), matrix, rtol=0, atol=1e-6)

    def test_unknown_kinds_and_shapes_are_refused_by_name(self) -> None:
        with pytest.raises(ValueError, match="weights: 'fp8'"):
            quantize(np.zeros((32, 2), np.float32), "fp8")
        with pytest.raises(ValueError, match="multiples of 32"):
            quantize(np.zeros((33, 2), np.float32), "q4")


def urgent_kw(seed: int) -> dict[str, Any]:
    return {"max_tokens": 16, "ignore_eos": True, "seed": seed}


def first_word_tokens(sink: RecordingSink) -> int:
    """Tokens until a space follows the first word (byte tokens: one per character), or
    0 if none does."""
    text = "".join(t for t, _ in sink.deltas) + (sink.final[0] if sink.final else "")
    found = re.search(r"\S\s", text)
    return found.end() if found and text[: found.end()].isascii() else 0


def submit_at(engine: Engine, prompt: str, priority: int, **kw: Any) -> RecordingSink:
    sink = RecordingSink()
    request = GenerationRequest(prompt, sampling=SamplingParams(**kw), priority=priority)
    engine.submit(request, sink)
    return sink


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
