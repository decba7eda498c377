"""The README's Python streaming example runs as written against a real stack."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from llmmesh.launcher import Stack

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_streaming_example(stack: Stack) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no Python example"
    code = blocks[0].replace("127.0.0.1:50051", stack.address("router"))
    output = io.StringIO()
    with (
        contextlib.redirect_stdout(output),
        pytest.MonkeyPatch.context() as env,
    ):
        env.setenv("LLM_MESH_API_KEY", stack.api_key)
        exec(compile(code, "README.md", "exec"), {})
    text = output.getvalue()
    assert "finish: FINISH_REASON_" in text
    assert "completion_tokens" in text
