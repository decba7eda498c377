"""Turns next-token logits into a token: masking, penalties, temperature, min-p, top-k,
top-p, seeded RNG."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from refengine.contract import SamplingParams
from refengine.structured import Constraint
from refengine.tokenizer import ByteTokenizer, Tokenizer


class OutputMasks:
    """One tokenizer's additive logit masks: the tokens a sequence may sample, with its
    end-of-sequence tokens and without them (``ignore_eos``). Made once per engine."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        allowed = tokenizer.output_mask()
        self.with_eos = np.where(allowed, 0.0, -np.inf)
        allowed[list(tokenizer.eos_ids)] = False
        self.without_eos = np.where(allowed, 0.0, -np.inf)

    def of(self, params: SamplingParams) -> npt.NDArray[np.float64]:
        return self.without_eos if params.ignore_eos else self.with_eos

    def early(self, params: SamplingParams) -> npt.NDArray[np.float64] | None:
        """The mask for a sequence's first ``min_tokens`` tokens, if it differs: no end of
        sequence, nor a stop token."""
        if not params.min_tokens or (params.ignore_eos and not params.stop_token_ids):
            return None
        if not params.stop_token_ids:
            return self.without_eos
        mask = self.without_eos.copy()
        mask[list(params.stop_token_ids)] = -np.inf
        return mask


BYTE_MASKS = OutputMasks(ByteTokenizer())


class Penalties:
    """A sequence's presence, frequency and repetition penalties (vLLM's), with what they
    read: how often each token is in its output, and which tokens its prompt has. Only
    the tokens seen are touched (a prompt and an output are a few hundred of a vocabulary
    of tens of thousands)."""

    def __init__(
        self, params: SamplingParams, vocab: int, prompt: Sequence[int], output: Sequence[int]
    ) -> None:
        self._params = params
        self._counts = np.zeros(vocab, dtype=np.float64)
        self._output: set[int] = set()
        self._seen: set[int] = set(prompt)
        self._arrays: tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]] | None = None
        for token in output:
            self.observe(token)

    def observe(self, token: int) -> None:
        self._counts[token] += 1.0
        if token not in self._output:
            self._output.add(token)
            self._seen.add(token)
            self._arrays = None

    def apply(self, scores: npt.NDArray[np.float64]) -> None:
        """Penalises one row of scores in place, as vLLM does: repetition first (on the
        prompt's and the output's tokens), then frequency and presence (the output's)."""
        params = self._params
        seen, output = self._indices()
        if params.repetition_penalty != 1.0:
            hit = scores[seen]
            factor = np.where(hit > 0, 1.0 / params.repetition_penalty, params.repetition_penalty)
            scores[seen] = hit * factor
        if params.frequency_penalty or params.presence_penalty:
            counts = self._counts[output]
            scores[output] -= params.frequency_penalty * counts + params.presence_penalty

    def _indices(self) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
        """The seen and output token ids as index arrays, made again only when a new token
        joins them."""
        if self._arrays is None:
            self._arrays = (
                np.fromiter(self._seen, dtype=np.intp, count=len(self._seen)),
                np.fromiter(self._output, dtype=np.intp, count=len(self._output)),
            )
        return self._arrays


class Sampler:
    """One per sequence: its RNG depends only on the request's seed, never on the batch.
    ``prompt``: its prompt's tokens; ``output``: those of them that are output it made
    before (a stream resumed elsewhere), which its penalties count as its own and its
    seeded draws step over."""

    def __init__(
        self,
        params: SamplingParams,
        masks: OutputMasks = BYTE_MASKS,
        prompt: Sequence[int] = (),
        output: Sequence[int] = (),
        constraint: Constraint | None = None,
        *,
        banned: Sequence[tuple[int, ...]] = (),
    ) -> None:
        self.params = params
        bits = np.random.PCG64(params.seed)  # numpy's default generator
        if params.seeded:
            # A stream resumed elsewhere draws what it would have drawn had it not moved:
            # one draw per token, so the output before took that many from the sequence.
            bits.advance(len(output))
        self._rng = np.random.Generator(bits)
        self.mask = _allowed(_biased(masks.of(params), params), params)
        early = masks.early(params)
        # Until it has min_tokens, a sequence may not end (vLLM's min_tokens).
        self._early_mask = None if early is None else _allowed(_biased(early, params), params)
        self.drawn = 0  # tokens this sampler has chosen
        self.constraint = constraint  # a structured output's grammar
        self.penalties = (
            Penalties(params, len(self.mask), prompt, output) if params.penalized else None
        )
        # Bad words' token sequences, and the output they are matched against.
        self.banned = tuple(banned)
        self._output = list(output) if banned else []
        # Whether the last mask left no token at all (the allowed ones all banned): the
        # output ends there, its draw not taken.
        self.exhausted = False
        # Whether the grammar's last mask left no token the model may write: its draw is
        # not a token, and the generation fails (the structure is the request's).
        self.dead_end = False

    def current_mask(self) -> npt.NDArray[np.float64]:
        mask = self.mask
        if self._early_mask is not None and self.drawn < self.params.min_tokens:
            mask = self._early_mask
        if self.constraint is not None:
            combined = mask + self.constraint.mask()
            self.dead_end = bool(combined.max() == -np.inf)  # one pass, no array made
            if not self.dead_end:  # else a draw the engine drops (never from no token)
                return combined
        return mask

    def ban_bad_words(self, scores: npt.NDArray[np.float64]) -> None:
        """Takes out of one row of scores, in place, each bad word's last token where the
        output ends with the rest of that word (vLLM's bad_words; a one-token word is
        always out). If that leaves no token, the row stays as it was and the sequence is
        ``exhausted``: the engine ends it and drops the draw. (In place: a copy of the
        mask per step would cost more than the rest of the row's sampling.)"""
        output = self._output
        last = [
            word[-1]
            for word in self.banned
            if len(word) == 1 or tuple(output[len(output) - len(word) + 1 :]) == word[:-1]
        ]
        if not last:
            return
        kept = scores[last].copy()
        scores[last] = -np.inf
        if not np.isfinite(scores).any():
            self.exhausted = True
            scores[last] = kept

    def accepted(self, token: int) -> None:
        """Notes a token drawn for this sequence."""
        self.drawn += 1
        if self.penalties is not None:
            self.penalties.observe(token)
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.banned:
            self._output.append(token)

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        return sample_batch([self], logits[None, :])[0]

    def draw(self, probs: npt.NDArray[np.float64]) -> int:
        """A token from unnormalised probabilities, by inverse CDF with this sequence's RNG."""
        params = self.params
        probs = _top_p(_top_k(_min_p(probs, params.min_p), params.top_k), params.top_p)
        cdf = np.cumsum(probs)
        index = int(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right"))
        return min(index, len(cdf) - 1)


def sample_batch(samplers: list[Sampler], logits: npt.NDArray[np.float32]) -> list[int]:
    """One token per row of ``logits`` [batch, vocab]. Row-wise operations only, so each
    sequence's token depends on its own logits and RNG, not on the rest of the batch."""
    scores = logits.astype(np.float64) + np.stack([s.current_mask() for s in samplers])
    for row, sampler in enumerate(samplers):
        if sampler.penalties is not None:
            sampler.penalties.apply(scores[row])
        if sampler.banned:
            sampler.ban_bad_words(scores[row])
    temperatures = np.array([s.params.temperature or 1.0 for s in samplers])[:, None]
    scaled = scores / temperatures
    probs = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    tokens = [
        int(np.argmax(scores[row])) if sampler.params.greedy else sampler.draw(probs[row])
        for row, sampler in enumerate(samplers)
    ]
    for sampler, token in zip(samplers, tokens, strict=True):
        sampler.accepted(token)
    return tokens


def _biased(mask: npt.NDArray[np.float64], params: SamplingParams) -> npt.NDArray[np.float64]:
    """``mask`` with the request's logit biases in (a masked token stays out)."""
    if not params.logit_bias:
        return mask
    tokens, biases = zip(*params.logit_bias, strict=True)
    biased = mask.copy()
    biased[list(tokens)] += biases
    return biased


def _min_p(probs: npt.NDArray[np.float64], p: float) -> npt.NDArray[np.float64]:
    """vLLM's min-p, first as vLLM applies it: the tokens at least ``p`` times as likely
    as the likeliest (the likeliest always stays)."""
    if p <= 0.0:
        return probs
    return np.where(probs >= p * probs.max(), probs, 0.0)


def _allowed(mask: npt.NDArray[np.float64], params: SamplingParams) -> npt.NDArray[np.float64]:
    """``mask`` with only the request's allowed tokens left (vLLM's allowed_token_ids)."""
    if not params.allowed_token_ids:
        return mask
    ids = list(params.allowed_token_ids)
    allowed = np.full_like(mask, -np.inf)
    allowed[ids] = mask[ids]
    return allowed


def _top_k(probs: npt.NDArray[np.float64], k: int) -> npt.NDArray[np.float64]:
    if k <= 0 or k >= np.count_nonzero(probs):
        return probs
    threshold = np.partition(probs, -k)[-k]
    return np.where(probs >= threshold, probs, 0.0)


def _top_p(probs: npt.NDArray[np.float64], p: float) -> npt.NDArray[np.float64]:
    if p >= 1.0:
        return probs
    order = np.argsort(probs)[::-1]
    cumulative = np.cumsum(probs[order]) / probs.sum()
    # Keep the smallest prefix whose mass reaches p (always at least one token).
    keep = order[: int(np.searchsorted(cumulative, p)) + 1]
    out = np.zeros_like(probs)
    out[keep] = probs[keep]
    return out


def score_token(
    logits: npt.NDArray[np.float32], token: int, top: int
) -> tuple[float, int, list[tuple[int, float]]]:
    """The sampled token's log probability under ``logits`` (the raw distribution), its
    rank, and the ``top`` most likely tokens with theirs, most likely first."""
    row = logits.astype(np.float64)
    peak = row.max()
    log_total = peak + np.log(np.exp(row - peak).sum())
    chosen = float(row[token] - log_total)
    rank = int(np.count_nonzero(row > row[token])) + 1
    best: list[tuple[int, float]] = []
    if top > 0:
        ids = np.argpartition(-row, top - 1)[:top]
        ids = ids[np.argsort(-row[ids], kind="stable")]
        best = [(int(i), float(row[i] - log_total)) for i in ids]
    return chosen, rank, best
