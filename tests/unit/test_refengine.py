"""The reference engine's parts: tokenizer, contract parsing, sampler, stops, transformer, loop."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from refengine import (
    ByteTokenizer,
    Engine,
    GenerationRequest,
    ModelShape,
    RequestError,
    SamplingParams,
    Transformer,
)
from refengine.contract import parse_sampling_parameters
from refengine.sampling import Sampler
from refengine.stops import StopMatcher
from refengine.tokenizer import BOS, EOS, StreamDecoder

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
        decoder = StreamDecoder()
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
            (b'{"stop": [""]}', "stop"),
            (b'{"bogus": 1}', "unknown keys"),
            (b"[1]", "JSON object"),
            (b"{", "not valid JSON"),
            (b"\xff", "UTF-8"),
        ],
    )
    def test_rejects_bad_values_naming_the_field(self, raw: bytes, field: str) -> None:
        with pytest.raises(RequestError, match=field):
            parse_sampling_parameters(raw)


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

    def test_eos_allowed_unless_ignored(self) -> None:
        logits = np.full(258, -50.0, dtype=np.float32)
        logits[EOS] = 50.0
        assert Sampler(SamplingParams(temperature=0.0)).sample(logits) == EOS
        assert Sampler(SamplingParams(temperature=0.0, ignore_eos=True)).sample(logits) != EOS


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

    def test_flush_releases_a_held_partial_match(self) -> None:
        stops = StopMatcher(("END",))
        assert stops.push("xEN") == "x"
        assert stops.flush() == "EN"


class TestTransformer:
    def test_incremental_decode_matches_a_full_forward_pass(self) -> None:
        model = Transformer(SMALL, seed=0)
        tokens = ByteTokenizer().encode("the kv cache must agree")
        full = model.forward(tokens, model.new_cache(64))
        cache = model.new_cache(64)
        model.forward(tokens[:10], cache)
        for token in tokens[10:-1]:
            model.forward([token], cache)
        incremental = model.forward(tokens[-1:], cache)
        np.testing.assert_allclose(incremental, full, rtol=1e-4, atol=1e-4)

    def test_weights_depend_on_the_seed(self) -> None:
        tokens = ByteTokenizer().encode("hi")
        a = Transformer(SMALL, seed=0).forward(tokens, Transformer(SMALL).new_cache(8))
        b = Transformer(SMALL, seed=1).forward(tokens, Transformer(SMALL).new_cache(8))
        assert not np.allclose(a, b)

    def test_context_overflow_is_refused(self) -> None:
        model = Transformer(SMALL, seed=0)
        with pytest.raises(ValueError, match="exceeds"):
            model.forward(list(range(10)), model.new_cache(4))


@dataclass
class RecordingSink:
    cancel_after: int | None = None
    deltas: list[tuple[str, int]] = field(default_factory=list)
    final: tuple[str, int, str] | None = None
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.deltas) >= self.cancel_after

    def emit(self, text: str, num_tokens: int) -> None:
        self.deltas.append((text, num_tokens))

    def finish(self, text: str, num_tokens: int, reason: str) -> None:
        self.final = (text, num_tokens, reason)
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


@pytest.fixture
def engine() -> Iterator[Engine]:
    running = Engine(Transformer(SMALL, seed=0))
    running.start()
    yield running
    running.stop()


def run(
    engine: Engine, prompt: str, sink: RecordingSink | None = None, **kw: object
) -> RecordingSink:
    sink = sink or RecordingSink()
    stream = bool(kw.pop("stream", True))
    engine.submit(GenerationRequest(prompt, stream=stream, sampling=SamplingParams(**kw)), sink)  # type: ignore[arg-type]
    assert sink.done.wait(30), "engine did not finish the request"
    return sink


class TestEngine:
    def test_streams_exactly_max_tokens_then_length(self, engine: Engine) -> None:
        sink = run(engine, "hello", max_tokens=20, ignore_eos=True, seed=1)
        assert sink.final is not None
        assert sink.final[2] == "length"
        assert sink.tokens == 20
        assert len(sink.text) == 20
        assert len(sink.deltas) >= 19

    def test_same_seed_same_text(self, engine: Engine) -> None:
        a = run(engine, "seeded", max_tokens=30, seed=42, ignore_eos=True)
        b = run(engine, "seeded", max_tokens=30, seed=42, ignore_eos=True)
        c = run(engine, "seeded", max_tokens=30, seed=43, ignore_eos=True)
        assert a.text == b.text
        assert a.text != c.text

    def test_stop_string_ends_generation_before_it(self, engine: Engine) -> None:
        free = run(engine, "stops", max_tokens=60, temperature=0.0, ignore_eos=True).text
        stop = free[20:23]
        cut = run(engine, "stops", max_tokens=60, temperature=0.0, ignore_eos=True, stop=[stop])
        assert cut.final is not None and cut.final[2] == "stop"
        assert cut.text == free[: free.index(stop)]

    def test_cancellation_stops_generation(self, engine: Engine) -> None:
        sink = run(
            engine, "cancel me", RecordingSink(cancel_after=3), max_tokens=500, ignore_eos=True
        )
        assert sink.final is not None and sink.final[2] == "cancelled"
        assert sink.tokens < 500
        assert engine.stats.finished["cancelled"] == 1

    def test_non_streaming_returns_prompt_and_text_once(self, engine: Engine) -> None:
        sink = run(engine, "whole", max_tokens=8, ignore_eos=True, stream=False, seed=0)
        assert sink.deltas == []
        assert sink.final is not None
        assert sink.final[0].startswith("whole") and len(sink.final[0]) == 5 + 8

    def test_prompt_longer_than_the_context_is_refused(self, engine: Engine) -> None:
        with pytest.raises(RequestError, match="text_input"):
            engine.submit(GenerationRequest("x" * 300), RecordingSink())

    def test_generation_stops_at_the_context_length(self, engine: Engine) -> None:
        sink = run(engine, "y" * 240, max_tokens=100, ignore_eos=True)
        assert sink.final is not None and sink.final[2] == "length"
        assert sink.tokens == SMALL.max_context - 241
