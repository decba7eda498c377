"""Model families, by the name a Triton model's ``family`` parameter gives: each builds a
model and its tokenizer from the model's config.pbtxt parameters."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from refengine.engine import LanguageModel
from refengine.tokenizer import ByteTokenizer, Tokenizer


@dataclass(frozen=True)
class ModelCard:
    """What a client of the model needs to speak its tokens (the mesh asks the model for
    it): the tokenizer (a Hugging Face ``tokenizers`` definition; empty for the byte-level
    one), the chat template (Jinja, as ``transformers`` renders it; empty: none), and the
    context the model serves."""

    max_context: int
    tokenizer_json: str = ""
    chat_template: str = ""
    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = False  # the engine puts the BOS token before every prompt


@dataclass(frozen=True)
class Built:
    model: LanguageModel
    tokenizer: Tokenizer
    card: ModelCard


Build = Callable[[Mapping[str, str]], Built]
FAMILIES: dict[str, Build] = {}
CACHE_ENV = "LLM_MESH_MODEL_CACHE"


def family(name: str) -> Callable[[Build], Build]:
    def register(build: Build) -> Build:
        FAMILIES[name] = build
        return build

    return register


def build_model(params: Mapping[str, str]) -> Built:
    name = params.get("family", "reference")
    if name not in FAMILIES:
        raise ValueError(f"family: {name!r} is not one of {sorted(FAMILIES)}")
    return FAMILIES[name](params)


def _cache_dir() -> Path:
    from refengine.checkpoint import DEFAULT_CACHE

    cache = os.environ.get(CACHE_ENV)
    return Path(cache) if cache else DEFAULT_CACHE


def _batch_invariant(params: Mapping[str, str]) -> bool:
    """``batch_invariant`` (default true): a sequence's logits, and so its seeded samples,
    are the same bits whatever else shares its batch; false trades that for plain, faster
    products (rowstable)."""
    value = params.get("batch_invariant", "true").lower()
    if value not in ("true", "false"):
        raise ValueError(f"batch_invariant: {value!r} is not true or false")
    return value == "true"


@family("reference")
def _reference(params: Mapping[str, str]) -> Built:
    """The small model with weights drawn from a seed (transformer.py)."""
    from refengine.transformer import ModelShape, Transformer

    shape = ModelShape.from_parameters(params)
    seed = int(params.get("weight_seed", 0))
    model = Transformer(shape, seed, _cache_dir() / "layouts", _batch_invariant(params))
    return Built(model, ByteTokenizer(), ModelCard(shape.max_context, add_bos=True))


@family("llama")
def _llama(params: Mapping[str, str]) -> Built:
    """A pretrained Llama-family model from a GGUF file (``model_file``)."""
    from refengine.bpe import BPETokenizer
    from refengine.checkpoint import load_checkpoint, resolve_model_file
    from refengine.llama import Llama

    if "model_file" not in params:
        raise ValueError("model_file: required for the llama family")
    checkpoint = load_checkpoint(resolve_model_file(params["model_file"]), _cache_dir())
    vocabulary = checkpoint.vocabulary
    tokenizer = BPETokenizer(
        vocabulary.tokenizer_json,
        eos_id=vocabulary.eos_id,
        bos_id=vocabulary.bos_id,
        add_bos=vocabulary.add_bos,
        special_ids=vocabulary.special_ids,
    )
    context = params.get("max_context")
    weights = params.get("weights", "float32")
    model = Llama(
        checkpoint,
        int(context) if context else None,
        checkpoint.cache_entry,
        weights,
        _batch_invariant(params),
    )
    card = ModelCard(
        max_context=model.shape.max_context,
        tokenizer_json=vocabulary.tokenizer_json,
        chat_template=vocabulary.chat_template or "",
        bos_token=tokenizer.token_text(vocabulary.bos_id),
        eos_token=tokenizer.token_text(vocabulary.eos_id),
        add_bos=vocabulary.add_bos,
    )
    return Built(model, tokenizer, card)
