"""Each served model's tokenizer as a Hugging Face tokenizer directory, for tools that need
one by path (token counters, benchmark clients): ``tokenizer.json`` and
``tokenizer_config.json`` (with the chat template), from the model's own card."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from llmmesh.client import internal_channel
from llmmesh.v1 import inference_pb2, inference_pb2_grpc


def write_tokenizer_dirs(
    inference: str, token: str, models: Iterable[str], directory: Path
) -> dict[str, Path]:
    """``directory/<model>/`` for each model with a tokenizer of its own (the byte-level
    models have none: their tokens are the text's UTF-8 bytes); asks the inference
    service at ``inference`` for the models' cards."""
    written: dict[str, Path] = {}
    with internal_channel(inference, token) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for model in models:
            card = stub.DescribeModel(inference_pb2.DescribeModelRequest(model=model), timeout=60)
            if not card.tokenizer_json:
                continue
            target = directory / model
            target.mkdir(parents=True, exist_ok=True)
            (target / "tokenizer.json").write_text(card.tokenizer_json, encoding="utf-8")
            config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": card.bos_token,
                "eos_token": card.eos_token,
                "add_bos_token": card.add_bos,
                "model_max_length": card.max_context,
                "chat_template": card.chat_template,
            }
            (target / "tokenizer_config.json").write_text(
                json.dumps(config, indent=2), encoding="utf-8"
            )
            written[model] = target
    return written
