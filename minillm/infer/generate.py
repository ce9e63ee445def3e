"""Sampling from a trained model with the KV cache, outside the model (nanochat's engine style).

Offers the batched loop `generate` (left-padded prompts, one KV cache, stop at end-of-text, a
sliding context past `max_seq_len`), `window_length` (how much of a row's text the model sees),
`TextStreamer` (streams text without breaking multi-byte UTF-8 characters) and
`sample_checkpoint`, what `minillm sample` runs. The pure filters and seeds live in
`minillm.infer.sampling` and are re-exported here.

Shape legend: B rows (prompts x samples), W longest window, V vocabulary.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from minillm.errors import UserError
from minillm.infer.sampling import (
    apply_temperature,
    check_sampling,
    row_seed,
    sample_from_probs,
    sample_next,
    top_k_filter,
    top_p_filter,
)
from minillm.model import KVCache
from minillm.model.decode import Decoder

__all__ = [
    "SampleSettings",
    "TextStreamer",
    "apply_temperature",
    "check_sampling",
    "encode_prompts",
    "generate",
    "read_prompts",
    "row_seed",
    "sample_checkpoint",
    "sample_from_probs",
    "sample_next",
    "top_k_filter",
    "top_p_filter",
    "window_length",
]

# ----------------------------------------------------------------------------- the loop


def window_length(n: int, context: int) -> int:
    """How many of the last tokens of a row's n-token text the model sees for the next token.

    All n while they fit the context. Past it the context slides like nanoGPT's crop, but in
    jumps so that the KV cache is refilled rarely: the window restarts at the last context // 2
    tokens and grows by one per token back up to the full context, then restarts again. It is a
    function of n alone, so a row sees the same windows whatever shares its batch.
    """
    if n <= context:
        return n
    keep = max(1, context // 2)
    return keep + (n - context - 1) % (context - keep + 1)


def _seeds(prompts: list[list[int]], seed: int | Sequence[int] | None) -> list[int]:
    """One generator seed per row: an int gives sample k of a prompt `row_seed(seed, k)`.

    k counts the earlier rows with the same prompt, so a prompt's k-th sample is the same text
    at any position of any batch, and repeated prompts (--num-samples) still differ.
    """
    if seed is None:
        return [int(s) for s in torch.randint(0, 2**62, (len(prompts),))]
    if isinstance(seed, int):
        occurrences: dict[tuple[int, ...], int] = {}
        seeds = []
        for p in prompts:
            k = occurrences.get(tuple(p), 0)
            occurrences[tuple(p)] = k + 1
            seeds.append(row_seed(seed, k))
        return seeds
    seeds = [int(s) for s in seed]
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    return seeds


class _Windows:
    """The rows' texts, and the prefill that (re)fills the KV cache with each row's window."""

    def __init__(
        self,
        model: torch.nn.Module,
        prompts: list[list[int]],
        cache_len: int,
        make_decoder: Callable[[torch.nn.Module, KVCache], Any],
    ) -> None:
        param = next(model.parameters())
        self.model, self.make_decoder = model, make_decoder
        self.context = model.cfg.max_seq_len
        self.texts = [list(p) for p in prompts]  # prompt + every token chosen since
        self.cache = KVCache(
            model.cfg, len(prompts), cache_len, device=param.device, dtype=param.dtype
        )
        self.longest = max(range(len(prompts)), key=lambda r: len(prompts[r]))  # a row index
        self.cached = [0] * len(prompts)  # tokens of each row's window in the cache
        self.slots = 0  # cache slots filled (the longest window; shorter ones are left-padded)

    def wanted(self) -> list[int]:
        return [window_length(len(t), self.context) for t in self.texts]

    def prefill(self) -> torch.Tensor:
        """Empty the cache, run every row's window through it; logits (B, V) of the next token."""
        windows = [t[len(t) - w :] for t, w in zip(self.texts, self.wanted(), strict=True)]
        B, W = len(windows), max(len(w) for w in windows)
        idx = torch.zeros(B, W, dtype=torch.long)  # (B, W) left-padded
        mask = torch.zeros(B, W, dtype=torch.bool)
        for r, w in enumerate(windows):
            idx[r, W - len(w) :] = torch.tensor(w, dtype=torch.long)
            mask[r, W - len(w) :] = True
        device = self.cache.k.device
        idx, mask = idx.to(device), mask.to(device)
        self.cache.reset()
        self.decoder = self.make_decoder(self.model, self.cache)  # before: it refuses dropout
        padded = not bool(mask.all())
        logits, _ = self.model(
            idx, attention_mask=mask if padded else None, kv_cache=self.cache, last_only=True
        )
        self.cached, self.slots = [len(w) for w in windows], W
        return logits[:, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) after each row's new token (already in `texts`): one decoder step while
        every window simply grows by that token and the cache has a slot, else a new prefill."""
        # Every text grows by one token per step: while the longest fits the context, every
        # window is its whole text and grows too (the common case, checked without a loop).
        grows = len(self.texts[self.longest]) <= self.context or all(
            w == c + 1 for w, c in zip(self.wanted(), self.cached, strict=True)
        )
        if not grows or self.slots + 1 > self.cache.max_len:
            return self.prefill()
        self.cached = [c + 1 for c in self.cached]
        self.slots += 1
        return self.decoder.step(tokens)


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
    on_slide: Callable[[], None] | None = None,
    vocab_limit: int | None = None,
    make_decoder: Callable[[torch.nn.Module, KVCache], Any] = Decoder,
) -> list[list[int]]:
    """Continue each prompt by up to max_new_tokens tokens; returns the new tokens of each row.

    The prompts run as one left-padded batch through one KV cache, and each row gives the tokens
    it gives alone (where the logits agree to float rounding): every row gets max_new_tokens, its
    windows depend on its own text only, and its draws on its own seed. A row stops after
    emitting eot_id (included in its output) unless ignore_eos. `seed` is one int (sample k of a
    prompt, k counting earlier rows with the same prompt, uses `row_seed(seed, k)`), one seed per
    row, or None (fresh randomness). A prompt must fit the context (model.max_seq_len); past it
    the context slides (`window_length`) and on_slide() is called once, when it first does.
    on_token(row, token) is called as each token is chosen. make_decoder: builds the
    one-token-at-a-time stepper (a mock model's own in tests). vocab_limit: never choose ids >=
    it (the rows of a padded embedding table that the tokenizer lacks). A model with dropout
    must be in eval mode.
    """
    check_sampling(temperature, top_k, top_p, max_new_tokens)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token")
    context = model.cfg.max_seq_len
    longest = max(len(p) for p in prompts)
    if longest > context:
        raise UserError(
            f"a prompt of {longest} tokens exceeds the model's context of {context} tokens "
            "(model.max_seq_len)"
        )
    B = len(prompts)
    # Uniforms are drawn on the CPU so that a seed gives the same text on every device.
    generators = None
    if temperature > 0.0:
        generators = [torch.Generator().manual_seed(s) for s in _seeds(prompts, seed)]

    # The longest text a forward sees: the longest prompt and all but the last new token.
    rows = _Windows(model, prompts, min(context, longest + max_new_tokens - 1), make_decoder)
    logits = rows.prefill()  # (B, V)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    slid = False
    for step in range(max_new_tokens):
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[:, vocab_limit:] = float("-inf")
        nxt = sample_next(logits, temperature, top_k, top_p, generators)  # (B,)
        tokens = nxt.tolist()  # the one host sync per step: streaming and stopping need it
        for r, t in enumerate(tokens):
            rows.texts[r].append(t)
            if done[r]:
                continue
            out[r].append(t)
            if on_token is not None:
                on_token(r, t)
            if t == eot_id and not ignore_eos:
                done[r] = True
        if all(done) or step == max_new_tokens - 1:
            break
        if not slid and any(len(t) > context for t in rows.texts):
            slid = True
            if on_slide is not None:
                on_slide()
        # Finished rows keep decoding (their tokens are discarded): the batch moves together.
        logits = rows.step(nxt)  # (B, V)
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
    of prompt j; each row is the text its prompt gives alone with the same seed. Every row gets
    max_new_tokens; past the context it slides, with one note on `err`.
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
        on_slide=lambda: print(
            f"note: the text outgrew the model's context of {context} tokens "
            f"(model.max_seq_len); from here each row sees its last {max(1, context // 2)} to "
            f"{context} tokens (a sliding window)",
            file=err,
        ),
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
