"""The reference engine's log probabilities (the sampled tokens' and the prompt's), prompt
ids, and quantized weights."""

from __future__ import annotations

import numpy as np
import pytest
from refengine import (
    ByteTokenizer,
    GenerationRequest,
    RequestError,
    SamplingParams,
    Transformer,
)
from refengine.attention import Segment
from refengine.contract import (
    parse_sampling_parameters,
)
from refengine.kvcache import BlockPool
from refengine.quant import quantize
from refengine.sequence import Details, TokenLogprob, logprob_entry

from tests.unit.model_repository.engines import (
    SMALL,
    RecordingSink,
    drain,
    make_engine,
    run,
    submit,
    submit_at,
)


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
