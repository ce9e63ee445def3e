"""The pure parts of sampling: filters, the draw, per-row seeds, the range checks.

Offers `apply_temperature`, `top_k_filter`, `top_p_filter`, `sample_from_probs`, `sample_next`,
`fresh_seed`, `row_seed`, `check_sampling`, `TokenLogprob` and `token_logprobs` (a token's
log-probability and its top alternatives); the loop that uses them is
`minillm.infer.engine`.

Shape legend: B rows, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from minillm.errors import UserError

# ----------------------------------------------------------------------------- pure filters


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature; temperature must be > 0 (0 means greedy and never gets here)."""
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties with the k-th are kept), -inf elsewhere.

    k = 0 or k >= V keeps everything. logits (..., V).
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches p (nucleus).

    A token is dropped when the tokens ranked above it already hold mass >= p, so the most
    likely token always stays; of tied tokens the lower id ranks first. p = 1 keeps everything.
    logits (..., V).
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (..., V) mass of the better-ranked tokens
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row b takes the first token whose cumulative mass exceeds u_b * total.

    probs (B, V) >= 0, uniforms (B,) in [0, 1). A token of probability 0 is never chosen.
    """
    cdf = probs.float().cumsum(dim=-1)  # (B, V)
    target = (uniforms.to(cdf.device, cdf.dtype) * cdf[:, -1])[:, None]  # (B, 1)
    index = torch.searchsorted(cdf, target, right=True)[:, 0]
    return index.clamp_(max=probs.shape[-1] - 1)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generators: Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """The next token of each row from logits (B, V): greedy at temperature 0, else sampled.

    Order as in Hugging Face: temperature, then top-k, then top-p. Row b draws its uniform from
    generators[b], so a row's tokens do not depend on which other rows share the batch.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = top_p_filter(
        top_k_filter(apply_temperature(logits.float(), temperature), top_k), top_p
    )
    probs = torch.softmax(logits, dim=-1)
    if generators is None:
        uniforms = torch.rand(logits.shape[0])
    else:
        uniforms = torch.cat([torch.rand(1, generator=g) for g in generators])
    return sample_from_probs(probs, uniforms)


def fresh_seed() -> int:
    """A random seed for a run given none: short enough to print and pass back (--seed, JSON)."""
    return int(torch.randint(0, 2**31 - 1, ()).item())


def row_seed(seed: int, row: int) -> int:
    """A well-mixed 63-bit seed for draw stream `row` of a run seeded with `seed`.

    The decoding core gives sample k of a prompt the stream k, not its position in a batch.
    """
    state = np.random.SeedSequence([seed & 0xFFFF_FFFF_FFFF_FFFF, row]).generate_state(2)
    return int((int(state[0]) << 32 | int(state[1])) & 0x7FFF_FFFF_FFFF_FFFF)


def check_sampling(temperature: float, top_k: int, top_p: float, max_new_tokens: int) -> None:
    """UserError for settings outside their range, naming the option."""
    if not temperature >= 0.0:  # also refuses NaN
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"--top-p must be in (0, 1] (1 = off), got {top_p}")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")


@dataclass
class TokenLogprob:
    """A token, its log-probability under the model (None for a first token without context)
    and the most likely alternatives at its position, (id, logprob) best first."""

    id: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top: int, limit: int) -> list:
    """TokenLogprob of each chosen id (N,) under logits (N, V); `top` alternatives among the
    ids below `limit` (the tokenizer's: a padded table's extra rows are no tokens)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values = logprobs.gather(-1, chosen[:, None].to(logprobs.device))[:, 0].tolist()
    alts: list[list[tuple[int, float]]] = [[] for _ in values]
    if top > 0:
        best = torch.topk(logprobs[:, :limit], min(top, limit), dim=-1)
        alts = [
            list(zip(i, v, strict=True))
            for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)
        ]
    return [TokenLogprob(t, v, a) for t, v, a in zip(chosen.tolist(), values, alts, strict=True)]
