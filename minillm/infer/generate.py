"""Sampling from a trained model with the KV cache, outside the model (nanochat's engine style).

Offers the pure sampling filters `apply_temperature`, `top_k_filter`, `top_p_filter`,
`sample_from_probs` and `sample_next`; `row_seed`; the batched loop `generate` (left-padded
prompts, one KV cache, stop at end-of-text); `TextStreamer` (streams text without breaking
multi-byte UTF-8 characters); and `sample_checkpoint`, what `minillm sample` runs.

Shape legend: B rows (prompts x samples), P longest prompt, V vocabulary.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from minillm.errors import UserError
from minillm.model import KVCache
from minillm.model.decode import Decoder

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


def row_seed(seed: int, row: int) -> int:
    """A well-mixed 63-bit seed for row `row` of a run seeded with `seed`."""
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


# ----------------------------------------------------------------------------- the loop


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | Sequence[int] | None = None,
    eot_id: int | None = None,
    ignore_eos: bool = False,
    on_token: Callable[[int, int], None] | None = None,
    vocab_limit: int | None = None,
    make_decoder: Callable[[torch.nn.Module, KVCache], Any] = Decoder,
) -> list[list[int]]:
    """Continue each prompt by up to max_new_tokens tokens; returns the new tokens of each row.

    The prompts run as one left-padded batch through one KV cache and give the same tokens as
    running them one at a time. A row stops after emitting eot_id (which is included in its
    output) unless ignore_eos. `seed` is one int (row r uses `row_seed(seed, r)`), one seed per
    row, or None (fresh randomness). on_token(row, token) is called as each token is chosen.
    make_decoder: builds the one-token-at-a-time stepper (a mock model's own in tests).
    vocab_limit: never choose ids >= it (the rows of a padded embedding table that the tokenizer
    lacks). The context must hold the longest prompt plus max_new_tokens - 1 tokens. A model
    with dropout must be in eval mode.
    """
    check_sampling(temperature, top_k, top_p, max_new_tokens)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token")
    cfg = model.cfg
    B, P = len(prompts), max(len(p) for p in prompts)
    if P + max_new_tokens - 1 > cfg.max_seq_len:
        raise UserError(
            f"{P} prompt tokens + {max_new_tokens} new tokens exceed the model's context of "
            f"{cfg.max_seq_len} tokens (model.max_seq_len)"
        )
    param = next(model.parameters())
    device = param.device

    generators = None
    if temperature > 0.0:
        if seed is None:
            seeds = [int(s) for s in torch.randint(0, 2**62, (B,))]
        elif isinstance(seed, int):
            seeds = [row_seed(seed, r) for r in range(B)]
        else:
            seeds = [int(s) for s in seed]
            if len(seeds) != B:
                raise ValueError(f"{len(seeds)} seeds for {B} prompts")
        # Uniforms are drawn on the CPU so that a seed gives the same text on every device.
        generators = [torch.Generator().manual_seed(s) for s in seeds]

    idx = torch.zeros(B, P, dtype=torch.long)  # (B, P) left-padded
    mask = torch.zeros(B, P, dtype=torch.bool)
    for r, p in enumerate(prompts):
        idx[r, P - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[r, P - len(p) :] = True
    idx, mask = idx.to(device), mask.to(device)
    padded = not bool(mask.all())

    cache = KVCache(cfg, B, P + max_new_tokens - 1, device=device, dtype=param.dtype)
    decoder = make_decoder(model, cache)  # before the prefill: it refuses live dropout
    logits, _ = model(idx, attention_mask=mask if padded else None, kv_cache=cache, last_only=True)
    logits = logits[:, -1]  # (B, V)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for step in range(max_new_tokens):
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[:, vocab_limit:] = float("-inf")
        nxt = sample_next(logits, temperature, top_k, top_p, generators)  # (B,)
        tokens = nxt.tolist()  # the one host sync per step: streaming and stopping need it
        for r, t in enumerate(tokens):
            if done[r]:
                continue
            out[r].append(t)
            if on_token is not None:
                on_token(r, t)
            if t == eot_id and not ignore_eos:
                done[r] = True
        if all(done) or step == max_new_tokens - 1:
            break
        # Finished rows keep decoding (their tokens are discarded): the batch moves together.
        logits = decoder.step(nxt)  # (B, V)
    return out


# ----------------------------------------------------------------------------- streaming text


class TextStreamer:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8 characters.

    Byte-level BPE can split one character over several tokens; decoding each token alone would
    print replacement characters. Like vLLM, only a short window of recent tokens is decoded.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were printed and end on a character boundary
        self.read = 0

    def push(self, token: int) -> str:
        """Add one token; return the text it completes (maybe empty)."""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back (a character cut by the end of generation)."""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]


# ----------------------------------------------------------------------------- the command


@dataclass
class SampleSettings:
    """What `minillm sample` was asked for; None takes the run config's `sample` section."""

    prompts: list[str]
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    num_samples: int = 1
    ignore_eos: bool = False


def read_prompts(prompts: list[str] | None, prompt_file: Path | None) -> list[str]:
    """The --prompt texts, then the --prompt-file text; an empty prompt is a UserError."""
    texts = list(prompts or [])
    for i, text in enumerate(texts):
        if text == "":
            raise UserError(f"--prompt number {i + 1} is empty (leave --prompt out to start fresh)")
    if prompt_file is not None:
        try:
            text = Path(prompt_file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"{prompt_file}: no such prompt file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{prompt_file}: cannot read the prompt file ({e})") from None
        if text == "":
            raise UserError(f"{prompt_file}: the prompt file is empty")
        texts.append(text)
    return texts


def encode_prompts(tokenizer: Any, texts: list[str], eot: int, context: int) -> list[list[int]]:
    """Token ids of each prompt after an end-of-text token: every sample is a fresh document.

    No texts means one prompt of just end-of-text. A prompt that fills the context is refused.
    """
    if not texts:
        return [[eot]]
    encoded = []
    for i, text in enumerate(texts):
        ids = [eot, *tokenizer.encode(text, add_special_tokens=False).ids]
        if len(ids) > context:
            raise UserError(
                f"prompt {i + 1} is {len(ids)} tokens (with the leading end-of-text); the model's "
                f"context is {context} tokens (model.max_seq_len)"
            )
        encoded.append(ids)
    return encoded


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def sample_checkpoint(
    ckpt: Any,
    settings: SampleSettings,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> list[str]:
    """Generate from a LoadedCheckpoint; one row streams to `out`, several are printed in turn.

    Returns the generated texts (without their prompts), row j*num_samples + k being sample k
    of prompt j. max_new_tokens is trimmed, with a note on `err`, where the context is too short.
    """
    from minillm.data.tokenizer import eot_id as find_eot

    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    defaults = ckpt.config.sample
    temperature = float(_pick(settings.temperature, defaults.temperature))
    top_k = int(_pick(settings.top_k, defaults.top_k))
    top_p = float(_pick(settings.top_p, defaults.top_p))
    max_new = int(_pick(settings.max_new_tokens, defaults.max_new_tokens))
    check_sampling(temperature, top_k, top_p, max_new)
    if settings.num_samples < 1:
        raise UserError(f"--num-samples must be >= 1, got {settings.num_samples}")

    tok, model = ckpt.tokenizer, ckpt.model
    # A prompt quoting "<|endoftext|>" means the text, not a document boundary (as in the shards).
    tok.encode_special_tokens = True
    eot = find_eot(tok)
    context = model.cfg.max_seq_len
    prompts = encode_prompts(tok, settings.prompts, eot, context)
    rows = [p for p in prompts for _ in range(settings.num_samples)]
    room = context - max(len(p) for p in rows) + 1
    if max_new > room:
        print(f"note: --max-new-tokens {max_new} cut to {room} to fit the context", file=err)
        max_new = room
    texts = settings.prompts or [""]
    seed = settings.seed
    if seed is None and temperature > 0:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
        print(f"seed {seed} (pass --seed to repeat this text)", file=err)

    streamer = TextStreamer(tok) if len(rows) == 1 else None
    if streamer is not None:
        out.write(texts[0])
        out.flush()

    def stream(row: int, token: int) -> None:
        piece = streamer.push(token)
        if piece:
            out.write(piece)
            out.flush()

    new = generate(
        model,
        rows,
        max_new_tokens=max_new,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eot_id=eot,
        ignore_eos=settings.ignore_eos,
        on_token=stream if streamer is not None else None,
        vocab_limit=tok.get_vocab_size(),
    )
    results = [tok.decode(ids) for ids in new]
    if streamer is not None:
        out.write(streamer.flush() + "\n")
    else:
        for r, text in enumerate(results):
            if r:
                out.write("\n" + "-" * 40 + "\n")
            out.write(texts[r // settings.num_samples] + text + "\n")
    out.flush()
    return results
