"""The README's Python streaming example runs as written against a real stack."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

import pytest

from llmmesh.launcher import Stack

README = Path(__file__).resolve().parents[2] / "README.md"


def run_example(stack: Stack, number: int) -> str:
    """What the README's Python example ``number`` prints, run against ``stack``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) > number, "README lacks the Python example"
    code = blocks[number].replace("127.0.0.1:50051", stack.address("router"))
    output = io.StringIO()
    with (
        contextlib.redirect_stdout(output),
        pytest.MonkeyPatch.context() as env,
    ):
        env.setenv("LLM_MESH_API_KEY", stack.api_key)
        exec(compile(code, "README.md", "exec"), {})
    return output.getvalue()


def test_readme_streaming_example(stack: Stack) -> None:
    text = run_example(stack, 0)
    assert "finish: FINISH_REASON_" in text
    assert "completion_tokens" in text


def test_readme_generate_stream_example(stack: Stack) -> None:
    answers = ast.literal_eval(run_example(stack, 1))
    assert len(answers) == 2 and all(answers), "two generations, each with text"
