"""Constrained decoding's cost: llguidance against xgrammar, and the decoding core with a schema.

    python scripts/bench_grammar.py                 # both engines, vocabularies 400, 32k, 151k
    python scripts/bench_grammar.py --engine-rows   # also the core's ms/token at 1 and 8 rows

Per engine and vocabulary: the time to compile a JSON schema (nested objects, enums, bounds,
arrays) for the tokenizer, and the mask's time per token while a valid JSON text of that schema
is fed token by token (median over the text's tokens; CPU, one row). The vocabularies: the
tests' byte-level BPE (400 tokens) and byte-level BPEs of 32,000 and 151,646 tokens built here
(random merges over GPT-2's byte alphabet: a mask's cost grows with the tokens it must check, not
with what they spell). With --engine-rows, the decoding core's milliseconds per step on a small
random model at 1 and 8 rows, free and under json_object, and the masks' own time per step.
Check the load (/proc/loadavg) first; each number is a median of repeats in one process.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Köln", "Rome", "Lisbon"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["C", "F"]},
        "stops": {"type": "array", "maxItems": 4,
                  "items": {"type": "object",
                            "properties": {"name": {"type": "string", "maxLength": 20},
                                           "hours": {"type": "number"}},
                            "required": ["name", "hours"], "additionalProperties": False}},
        "note": {"type": "string"},
    },
    "required": ["city", "days", "units", "stops", "note"],
    "additionalProperties": False,
}  # fmt: skip
TEXT = json.dumps(
    {
        "city": "Köln",
        "days": 3,
        "units": "C",
        "stops": [{"name": "Dom", "hours": 1.5}, {"name": "Rhein bank", "hours": 2}],
        "note": "Take an umbrella; the weather in the Rhineland changes by the hour.",
    },
    ensure_ascii=False,
    separators=(",", ":"),
)


def synthetic_bpe(size: int, seed: int = 0) -> str:
    """A byte-level BPE of `size` tokens (tokenizer.json text): every token extends an earlier
    one by a character, so its merges are valid; plus an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tokens, merges = list(vocab), []
    rng = random.Random(seed)
    common = [c for c in alphabet if c.isalnum()] + ["Ġ"] * 8  # spaces start many tokens
    while len(vocab) < size - 1:
        parent = rng.choice(tokens[-5000:] if rng.random() < 0.7 else tokens)
        if len(parent) > 12:
            continue
        child = parent + rng.choice(common)
        if child in vocab:
            continue
        vocab[child] = len(vocab)
        tokens.append(child)
        merges.append((parent, child[len(parent) :]))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok.to_str()


def tests_bpe() -> str:
    from tests.published import family_tokenizer

    return family_tokenizer("chatml").to_str()


def bench_llguidance(tokenizer_json: str, ids: list[int], eos: int) -> dict[str, float]:
    import llguidance
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    ll_tok = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}
    )
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(ll_tok, grammar)
    compile_ms = (time.perf_counter() - start) * 1000
    assert not matcher.is_error(), matcher.get_error()
    mask = allocate_token_bitmask(1, ll_tok.vocab_size)
    times = []
    for t in ids:
        start = time.perf_counter()
        fill_next_token_bitmask(matcher, mask)
        times.append(time.perf_counter() - start)
        assert bool((mask[0, t // 32] >> (t % 32)) & 1), "the text's token is masked out"
        assert matcher.consume_token(t), matcher.get_error()
    return {"compile_ms": compile_ms, "mask_us": statistics.median(times) * 1e6}


def bench_xgrammar(tokenizer_json: str, ids: list[int], eos: int) -> dict[str, float]:
    import transformers
    from tokenizers import Tokenizer

    try:
        import xgrammar as xg
    except ImportError:
        raise SystemExit("xgrammar is not installed: pip install -e '.[grammar-bench]'") from None

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
    info = xg.TokenizerInfo.from_huggingface(hf, stop_token_ids=[eos])
    compiler = xg.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    compile_ms = (time.perf_counter() - start) * 1000
    matcher = xg.GrammarMatcher(compiled)
    mask = xg.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for t in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - start)
        assert bool((mask[0, t // 32] >> (t % 32)) & 1), "the text's token is masked out"
        assert matcher.accept_token(t)
    return {"compile_ms": compile_ms, "mask_us": statistics.median(times) * 1e6}


def engine_rows(rows: int, grammar: bool, tokens: int = 48) -> float:
    """The decoding core's ms per token per row at `rows` rows (a small random model)."""
    import torch

    from minillm.infer.engine import Engine, SamplingParams
    from minillm.infer.grammar import Grammar, grammar_tokenizer, json_schema_grammar
    from minillm.model import Transformer
    from tests.helpers import tiny_model_config
    from tests.published import family_tokenizer

    tok = family_tokenizer("chatml")
    cfg = tiny_model_config(vocab_size=tok.get_vocab_size(), n_layer=4, d_model=256, n_head=4,
                            n_kv_head=4, max_seq_len=512)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    g = None
    if grammar:
        g = Grammar.compile(grammar_tokenizer(tok, {0}), json_schema_grammar({"type": "object"}))
    params = SamplingParams(tokens, 1.0, 0, 1.0, seed=1, grammar=g)
    best = []
    for _ in range(3):
        engine = Engine(model, tok)
        engine.submit([tok.encode("Hello").ids] * rows, params)
        engine.step()  # the prefill
        start = time.perf_counter()
        while engine.busy():
            engine.step()
        n = engine.generated - rows
        best.append((time.perf_counter() - start) / max(n / rows, 1) * 1000)
    return statistics.median(best)


def mask_step(rows: int) -> float:
    """Milliseconds the core spends per step on the masks of `rows` json_object rows (computed
    and applied, Masks.apply as on the CPU): the cost a step adds, free of the forward's noise."""
    import torch

    from minillm.infer.grammar import Grammar, Masks, grammar_tokenizer, json_schema_grammar
    from tests.published import family_tokenizer

    tok = family_tokenizer("chatml")
    grammar = Grammar.compile(grammar_tokenizer(tok, {0}), json_schema_grammar({"type": "object"}))
    ruled = [grammar.start() for _ in range(rows)]
    for g in ruled:
        g.advance(tok.token_to_id("{"))
    masks, logits = Masks(overlap=False), torch.randn(rows, tok.get_vocab_size() + 16)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        masks.apply(ruled, logits, None, tok.get_vocab_size())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-rows", action="store_true", help="also the core at 1 and 8 rows")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    with open("/proc/loadavg") as f:
        print(f"load {f.read().split()[:3]}")
    if args.engine_rows:  # first: xgrammar's import leaves threads that slow torch's
        print("| rows | free (ms/step) | json_object (ms/step) | change | masks (ms/step) |")
        print("|---:|---:|---:|---:|---:|")
        for rows in (1, 8):
            free, ruled, masks = engine_rows(rows, False), engine_rows(rows, True), mask_step(rows)
            print(f"| {rows} | {free:.2f} | {ruled:.2f} | {ruled / free - 1:+.0%} | {masks:.3f} |")
        print()
    vocabularies = {"tests 400": tests_bpe(), "bpe 32k": synthetic_bpe(32_000),
                    "bpe 151k": synthetic_bpe(151_646)}  # fmt: skip
    print("| vocabulary | engine | schema compile (ms) | mask per token (µs, median) |")
    print("|---|---|---:|---:|")
    for name, text in vocabularies.items():
        tok = Tokenizer.from_str(text)
        ids = tok.encode(TEXT, add_special_tokens=False).ids
        eos = tok.token_to_id("<|endoftext|>")
        for engine, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            runs = [bench(text, ids, eos) for _ in range(3)]
            c = statistics.median(r["compile_ms"] for r in runs)
            m = statistics.median(r["mask_us"] for r in runs)
            print(f"| {name} ({tok.get_vocab_size()}) | {engine} | {c:.1f} | {m:.1f} |")


if __name__ == "__main__":
    main()
