"""The reference LLM engine: a small decoder-only transformer in numpy, served by Triton.

Pure Python + numpy, no Triton imports, so every part is unit-tested directly; ``model.py``
next to this package adapts it to Triton's Python backend.
"""

from refengine.contract import GenerationRequest, RequestError, SamplingParams
from refengine.engine import Engine, EngineConfig, EngineStats
from refengine.sequence import Sink
from refengine.tokenizer import ByteTokenizer
from refengine.transformer import ModelShape, Transformer

__all__ = [
    "ByteTokenizer",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "GenerationRequest",
    "ModelShape",
    "RequestError",
    "SamplingParams",
    "Sink",
    "Transformer",
]
