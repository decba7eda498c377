"""The policy benchmark's escaped and encoded prompts: the views, and the input check's
decoding, read them back as the prose they hide, so their rows time that reading and
nothing else. Its long conversation is one a router takes, and refuses only once read."""

from __future__ import annotations

from bench.policy import (
    LONG_PROMPT_CHARS,
    PROMPT_CHARS,
    encoded,
    escaped,
    hex_bytes,
    long_conversation,
    prompts,
)
from llmmesh.policy import Part, RuleSet, check_input
from llmmesh.policy.encoded import DecodedText
from llmmesh.policy.normalize import pattern_view
from llmmesh.types import PolicyAction
from services.policy.config import DEFAULT_RULES
from services.router.config import RouterConfig


def test_an_escaped_prompt_reads_back_as_its_prose() -> None:
    for prompt in prompts(8, 1):
        written = escaped(prompt)
        assert len(written) <= PROMPT_CHARS and all(f in written for f in ("%", "&#", "\\u"))
        read = pattern_view(written).text
        assert prompt.startswith(read[:-20])  # the cut at 4 KB may halve the last escape


def test_an_encoded_prompt_decodes_back_to_its_prose() -> None:
    for prompt in prompts(8, 1):
        written = encoded(prompt)
        assert len(written) <= PROMPT_CHARS and " " not in written[:16]
        # The runs read whole (side by side, runs of one length are also read as one)
        read = [r for r in DecodedText.of(written).runs if " " not in written[r.start : r.end]]
        long_enough = [r for r in written.split(" ") if len(r) >= 12]  # 9 bytes or more
        assert len(read) == len(long_enough) > 100  # every such run reads as text
        assert prompt.startswith(" ".join(r.text for r in read)[:-20])  # the cut at 4 KB


def test_a_hexadecimal_prompt_decodes_back_to_its_prose() -> None:
    for prompt in prompts(8, 1):
        written = hex_bytes(prompt)
        assert len(written) == PROMPT_CHARS and " " in written[:3]
        [run] = DecodedText.of(written).runs  # one run of pieces, the whole prompt
        assert (run.start, prompt.startswith(run.text)) == (0, True)
        assert len(run.text) == (PROMPT_CHARS + 1) // 3


def test_the_long_conversation_is_taken_whole_and_refused_by_its_last_message() -> None:
    messages = long_conversation(3)
    fields = RouterConfig.model_fields
    assert max(len(m["content"]) for m in messages) <= fields["max_prompt_chars"].default
    total = sum(len(m["content"]) for m in messages)
    assert LONG_PROMPT_CHARS < total <= fields["max_conversation_chars"].default
    rules = RuleSet.from_file(DEFAULT_RULES)
    parts = [Part(f"messages[{i}].content", m["content"]) for i, m in enumerate(messages)]
    # The numbers alone are not refused (some rows read as cards, and are redacted): the
    # refusal comes once the last message is read.
    assert check_input(rules, parts[:-1]).verdict(rules).action is not PolicyAction.DENY
    assert (
        check_input(rules, parts).verdict(rules).denied_at == f"messages[{len(parts) - 1}].content"
    )
