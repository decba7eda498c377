"""The quantization benchmark's measures: KL divergence, same top token and perplexity as
llama.cpp's llama-perplexity defines them, and its public-domain text set."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.quantization import Scores, bible_text


def test_identical_distributions_diverge_by_nothing() -> None:
    logits = np.random.default_rng(0).normal(size=(5, 40)).astype(np.float32)
    scores = Scores([], [], [])
    scores.add(logits, logits.copy(), [0, 1, 2, 3, 4])
    summary = scores.summary()
    assert summary["kld_mean"] == pytest.approx(0.0, abs=1e-12)
    assert summary["same_top"] == 1.0
    assert summary["positions"] == 5


def test_scores_follow_their_definitions() -> None:
    # Two positions over three tokens: the second position's top token differs.
    reference = np.log(np.array([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]]))
    mine = np.log(np.array([[0.6, 0.3, 0.1], [0.2, 0.6, 0.2]]))
    scores = Scores([], [], [])
    scores.add(reference, mine, [0, 1])
    summary = scores.summary()
    kld = [
        sum(p * math.log(p / q) for p, q in zip(ps, qs, strict=True))
        for ps, qs in (([0.7, 0.2, 0.1], [0.6, 0.3, 0.1]), ([0.5, 0.3, 0.2], [0.2, 0.6, 0.2]))
    ]
    assert summary["kld_mean"] == pytest.approx(sum(kld) / 2)
    assert summary["kld_p99"] == pytest.approx(np.percentile(kld, 99))
    assert summary["same_top"] == 0.5
    # Perplexity of the tokens that came: exp of the mean negative log probability.
    assert summary["ppl"] == pytest.approx(math.exp(-(math.log(0.6) + math.log(0.6)) / 2))


def test_the_text_set_is_genesis_a_verse_a_line() -> None:
    text = bible_text()
    lines = text.splitlines()
    assert lines[0] == "In the beginning God created the heaven and the earth."
    assert len(lines) == 1533  # Genesis's verses
    assert not any(line[:1].isdigit() for line in lines)  # no verse numbers left
