"""The policy benchmark's escaped prompts: the views read them back as the prose they
escape, so their row times the escapes' reading and nothing else."""

from __future__ import annotations

from bench.policy import PROMPT_CHARS, escaped, prompts
from llmmesh.policy.normalize import pattern_view


def test_an_escaped_prompt_reads_back_as_its_prose() -> None:
    for prompt in prompts(8, 1):
        written = escaped(prompt)
        assert len(written) <= PROMPT_CHARS and all(f in written for f in ("%", "&#", "\\u"))
        read = pattern_view(written).text
        assert prompt.startswith(read[:-20])  # the cut at 4 KB may halve the last escape
