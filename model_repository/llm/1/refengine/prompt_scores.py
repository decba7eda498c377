"""A prompt's log probabilities (vLLM's ``prompt_logprobs``), scored as its positions are
computed: which rows of a step's tokens need logits, and each prompt token's score from
the row before it. The engine reads no cached block for such a prompt (a cached block has
no logits), so every position comes through a step exactly once, or again after a
preemption, when it is not scored twice."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from refengine.sampling import score_token
from refengine.sequence import Sequence, TokenLogprob

Batch = list[tuple[Sequence, int]]  # a step's sequences and the tokens each computes


def logit_rows(batch: Batch) -> tuple[npt.NDArray[np.intp] | None, list[int]]:
    """The rows of the step's tokens whose logits the step needs, and where each
    segment's last row is among them: each segment's last (its next token), and every
    row of a prompt being scored. None: the last rows only (the model's default)."""
    if not any(seq.scores_prompt for seq, _ in batch):
        return None, list(range(len(batch)))
    rows: list[int] = []
    lasts: list[int] = []
    start = 0
    for seq, n in batch:
        rows.extend(range(start, start + n) if seq.scores_prompt else (start + n - 1,))
        lasts.append(len(rows) - 1)
        start += n
    return np.array(rows, dtype=np.intp), lasts


def score_prompts(
    batch: Batch,
    every: npt.NDArray[np.float32],
    lasts: list[int],
    text: Callable[[list[int]], str],
) -> None:
    """Scores the prompt tokens this step's rows (``every``, as ``logit_rows`` chose them)
    predict, for the sequences that want them; a position scored before is not again."""
    for (seq, n), last in zip(batch, lasts, strict=True):
        if not seq.scores_prompt:
            continue
        top = seq.request.sampling.prompt_logprobs or 0
        if seq.prompt_from == 0 and not seq.prompt_scores:  # nothing precedes it
            first = seq.tokens[0]
            seq.prompt_scores.append(TokenLogprob(first, text([first]), 0.0, 0))
        # Row last - n + 1 holds the logits after position seq.computed, which score the
        # token after it.
        after = last - n + 1 - seq.computed  # + position: its row
        start = seq.prompt_from + len(seq.prompt_scores)
        for index in range(start, min(seq.computed + n + 1, seq.prompt_len)):
            token = seq.tokens[index]
            logprob, rank, best = score_token(every[after + index - 1], token, top)
            listed = tuple((i, text([i]), lp) for i, lp in best)
            seq.prompt_scores.append(TokenLogprob(token, text([token]), logprob, rank, listed))
