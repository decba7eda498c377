"""The reference engine's parts: tokenizer, contract parsing, sampler, penalties, structured
outputs, stops, transformer, row-stable products, parameters."""

from __future__ import annotations

import json
import re
import warnings
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import pytest
from refengine import (
    ByteTokenizer,
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
    StructuredOutput,
    parse_sampling_parameters,
)
from refengine.engine import STRUCTURE_DEAD_END, STRUCTURE_FIELD
from refengine.kvcache import BlockPool
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
from refengine.stops import StopMatcher
from refengine.tokenizer import BOS, EOS
from refengine.transformer import _gelu

from bench.engine import model_parameters
from tests.unit.model_repository.engines import (
    SMALL,
    RecordingSink,
    drain,
    make_engine,
    run,
    submit,
)


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

    def test_a_grammar_that_leaves_no_writable_token_is_a_dead_end(self) -> None:
        class OnlyControlBytes:  # a grammar that allows only what the model never writes
            def mask(self) -> npt.NDArray[np.float64]:
                mask = np.full(258, -np.inf)
                mask[1] = 0.0
                return mask

        sampler = Sampler(SamplingParams(), constraint=OnlyControlBytes())  # type: ignore[arg-type]
        assert not sampler.dead_end
        sampler.current_mask()
        assert sampler.dead_end

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

    def test_a_structure_the_model_cannot_write_fails_as_the_requests_fault(self) -> None:
        """A control byte is outside what the byte-level model may write: the grammar
        leaves no token, and the failure names the field without quoting the grammar."""
        sink = self.structured("choice", json.dumps(["a\x01b"]), max_tokens=20)
        assert sink.error.startswith(STRUCTURE_FIELD + ": ")
        assert "\n" not in sink.error and len(sink.error) < 300  # not the grammar's state
        # A grammar and allowed tokens with nothing in common: no draw from no token (its
        # probabilities would be NaN).
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            none_left = self.structured("choice", '["b"]', allowed_token_ids=[ord("a")])
        assert none_left.error == STRUCTURE_DEAD_END and not none_left.deltas
        # A pattern it cannot finish: failed too, never ended early as if it were whole.
        unfinished = self.structured("regex", "ok\x01", max_tokens=20)
        assert unfinished.final is None and unfinished.error.startswith(STRUCTURE_FIELD)
        # One the grammar cannot build (a million characters in a row): said so.
        huge = self.structured("regex", "(a{1000}){1000}", max_tokens=4)
        assert huge.error.startswith(STRUCTURE_FIELD + ": the output cannot go on within it (")

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
