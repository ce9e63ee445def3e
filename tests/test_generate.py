"""Sampling: exact filter tables, the loop (EOT, batching, seeds), HF parity, streaming, the CLI."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.config import ModelConfig
from minillm.infer.engine import Engine, SamplingParams, generate, window_length
from minillm.infer.sampling import (
    apply_temperature,
    row_seed,
    sample_from_probs,
    sample_next,
    top_k_filter,
    top_p_filter,
)
from minillm.infer.text_stream import TextStreamer
from minillm.tokenizer.bpe import eot_id
from tests.helpers import make_run, tiny_tokenizer

INF = math.inf

# ----------------------------------------------------------------------------- pure filters


def test_temperature_divides_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    assert torch.equal(apply_temperature(logits, 0.5), torch.tensor([[4.0, -2.0, 1.0]]))
    assert apply_temperature(logits, 1.0) is logits


@pytest.mark.parametrize(
    "k, expected",
    [
        (0, [3.0, 1.0, 2.0, 1.0, 0.0]),  # off
        (1, [3.0, -INF, -INF, -INF, -INF]),
        (2, [3.0, -INF, 2.0, -INF, -INF]),
        (3, [3.0, 1.0, 2.0, 1.0, -INF]),  # a tie with the k-th is kept (as in HF)
        (5, [3.0, 1.0, 2.0, 1.0, 0.0]),
        (9, [3.0, 1.0, 2.0, 1.0, 0.0]),
    ],
)
def test_top_k_table(k: int, expected: list[float]) -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 1.0, 0.0]])
    assert top_k_filter(logits, k).tolist() == [expected]


# Probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 in a shuffled order.
P_LOGITS = torch.log(torch.tensor([[0.125, 0.5, 0.0625, 0.25, 0.0625]]))


@pytest.mark.parametrize(
    "p, kept",
    [
        (1.0, [0, 1, 2, 3, 4]),
        (0.3, [1]),  # the top token alone holds 0.5 >= 0.3
        (0.5, [1]),
        (0.6, [1, 3]),
        (0.8, [0, 1, 3]),
        (0.9, [0, 1, 2, 3]),  # 0.875 < 0.9: one 0.0625 token more, the lower id of the tie
        (0.95, [0, 1, 2, 3, 4]),  # 0.9375 < 0.95
        (1e-9, [1]),  # the most likely token always stays
    ],
)
def test_top_p_table(p: float, kept: list[int]) -> None:
    out = top_p_filter(P_LOGITS, p)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == kept
    assert torch.equal(out[0, kept], P_LOGITS[0, kept])


@pytest.mark.parametrize(
    "u, token",
    [(0.0, 1), (0.12, 1), (0.125, 3), (0.5, 3), (0.625, 4), (0.999, 4)],
)
def test_inverse_cdf_table_never_picks_zero_probability(u: float, token: int) -> None:
    probs = torch.tensor([[0.0, 0.125, 0.0, 0.5, 0.375]])  # cdf 0, 1/8, 1/8, 5/8, 1: exact
    assert sample_from_probs(probs, torch.tensor([u])).tolist() == [token]


def test_sample_next_greedy_and_filters_compose() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample_next(logits, 0.0).tolist() == [1, 0]
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    for _ in range(20):  # top-k 1 at any temperature is greedy
        assert sample_next(logits, 1.7, top_k=1, generators=gens).tolist() == [1, 0]
    seen = {sample_next(logits[:1], 1.0, top_k=2, generators=gens[:1]).item() for _ in range(50)}
    assert seen == {1, 2}


def test_row_seeds_are_distinct_and_stable() -> None:
    seeds = [row_seed(7, r) for r in range(100)]
    assert len(set(seeds)) == 100 and row_seed(7, 3) == seeds[3] != row_seed(8, 3)
    assert all(0 <= s < 2**63 for s in seeds)


# ----------------------------------------------------------------------------- the loop


def sp(n: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, **kw):
    """SamplingParams with every setting given (no run defaults here)."""
    return SamplingParams(n, temperature, top_k, top_p, **kw)


class CountingModel(torch.nn.Module):
    """A mock: the next token is always last token + 1 (mod V), whatever the cache holds."""

    def __init__(self, vocab: int = 16) -> None:
        super().__init__()
        self.cfg = ModelConfig(vocab_size=vocab, d_model=8, n_layer=1, n_head=2, max_seq_len=32)
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.calls: list[tuple[int, int]] = []

    def forward(self, idx):
        self.calls.append(tuple(idx.shape))
        nxt = (idx[:, -1] + 1) % self.cfg.vocab_size
        logits = torch.nn.functional.one_hot(nxt, self.cfg.vocab_size).float()[:, None] * 10
        return logits, None


class CountingDecoder:
    """The Engine's stepper for the mock: each prefill or step is one forward of it."""

    def __init__(self, model: CountingModel, cache) -> None:
        self.model, self.cache = model, cache

    def prefill(self, row: int, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        self.cache.clear_row(row)
        logits = self.model(ids[None])[0][0]
        return logits if all_logits else logits[-1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens[:, None])[0][:, -1]


MOCK = {"decoder": CountingDecoder}


def test_rows_stop_at_a_stop_id_and_leave_the_batch() -> None:
    model = CountingModel()
    engine = Engine(model, **MOCK)
    rows = engine.submit([[1], [9, 10]], sp(6, stop_ids=frozenset([4])))
    seen: list[tuple[int, int]] = []
    engine.run(lambda e: seen.append((rows.index(e.row), e.token)))
    assert [r.tokens for r in rows] == [[2, 3, 4], [11, 12, 13, 14, 15, 0]]
    assert [r.finish_reason for r in rows] == ["stop", "length"]
    assert seen[:4] == [(0, 2), (1, 11), (0, 3), (1, 12)]
    # each prompt prefilled alone, then 5 steps (the last token needs no forward); row 0 left
    # after its stop id, so the last three steps ran one row
    assert model.calls == [(1, 1), (1, 2), (2, 1), (2, 1), (1, 1), (1, 1), (1, 1)]
    model = CountingModel()
    out = generate(model, [[1]], sp(8, stop_ids=frozenset([4])), **MOCK)
    assert out == [[2, 3, 4]] and len(model.calls) == 3  # stops as soon as every row is done
    out = generate(CountingModel(), [[1]], sp(5), **MOCK)  # no stop ids: --ignore-eos
    assert out == [[2, 3, 4, 5, 6]]


def test_identical_prompts_are_prefilled_once() -> None:
    model = CountingModel()
    out = generate(model, [[3, 4], [7], [3, 4]], sp(2, 1.0, seed=1), n=2, **MOCK)
    assert len(out) == 6 and model.calls[:2] == [(1, 2), (1, 1)]  # two prefills for 6 rows


def test_vocab_limit_keeps_the_padded_embedding_rows_out() -> None:
    # The mock wants 15 next; ids >= 15 are off-limits, so greedy falls back to id 0.
    out = generate(CountingModel(), [[14]], sp(1), vocab_limit=15, **MOCK)
    assert out == [[0]]
    sampled = generate(CountingModel(), [[3]] * 8, sp(12, 50.0, seed=0), vocab_limit=6, **MOCK)
    assert {t for row in sampled for t in row} == set(range(6))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    root = tmp_path_factory.mktemp("gen")
    run_dir, cfg, _ = make_run(root)
    return run_dir, load_checkpoint(run_dir)


PROMPTS = [[5, 17, 42, 99, 7, 8, 120], [3], [250, 11, 12]]


def test_same_seed_same_tokens_other_seed_other_tokens(run) -> None:
    model = run[1].model
    kw = dict(temperature=1.0, top_k=50, top_p=0.95)
    a = generate(model, PROMPTS, sp(20, seed=123, **kw))
    b = generate(model, PROMPTS, sp(20, seed=123, **kw))
    c = generate(model, PROMPTS, sp(20, seed=124, **kw))
    assert a == b and a != c
    assert all(len(row) == 20 for row in a)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_equals_one_at_a_time(run, temperature: float) -> None:
    model = run[1].model
    params = sp(25, temperature, top_k=40, top_p=0.9, seed=7)
    batched = generate(model, PROMPTS, params)
    for r, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], params)
        assert alone[0] == batched[r], f"row {r}"
    if temperature > 0:  # the rows really are sampled, not all greedy
        greedy = generate(model, PROMPTS, sp(25, 0.0))
        assert greedy != batched


def test_rows_join_and_leave_mid_batch_with_their_own_settings(run) -> None:
    # A server's day: rows with different settings join while others run and leave at
    # different steps (stop ids, lengths, a cancel); each row's tokens are those it gets alone.
    model, tok = run[1].model, run[1].tokenizer
    eot = eot_id(tok)
    plan = [  # (prompt, params, step at which it joins)
        (PROMPTS[0], sp(18, 0.0), 0),
        (PROMPTS[1], sp(9, 1.0, top_k=20, seed=4), 0),
        (PROMPTS[2], sp(30, 0.7, top_p=0.8, seed=9, stop_ids=frozenset([eot])), 3),
        (PROMPTS[1], sp(12, 1.3, seed=5), 5),
        (PROMPTS[0], sp(6, 0.0), 11),
    ]
    engine = Engine(model, tok, max_batch=3)
    rows, step = [], 0
    cancelled = None
    while len(rows) < len(plan) or engine.busy():
        for prompt, params, join in plan[len(rows) :]:
            if join > step:
                break
            rows += engine.submit([prompt], params)
        if cancelled is None and len(rows) > 3 and len(rows[3].tokens) == 4:
            cancelled = rows[3]  # it leaves early: its tokens so far are its first ones
            engine.cancel(cancelled)
        for event in engine.step():
            assert event.error is None
        step += 1
    assert len(engine.active) == 0 and engine.cache.nbytes() == 0
    assert cancelled.finish_reason == "cancelled" and len(cancelled.tokens) == 4
    for row, (prompt, params, _) in zip(rows, plan, strict=True):
        alone = generate(model, [prompt], params, tokenizer=tok)[0]
        if row is cancelled:
            assert row.tokens == alone[: len(row.tokens)]
        else:
            assert row.tokens == alone and row.finish_reason in ("stop", "length")


def test_stop_strings_across_token_boundaries(run) -> None:
    # A stop string that starts inside one token and ends in a later one: the text stops right
    # before it, nothing of it is ever released, and the row stops generating there.
    model, tok = run[1].model, run[1].tokenizer
    prompt = PROMPTS[0]
    alone = generate(model, [prompt], sp(40), tokenizer=tok)[0]
    pieces = [tok.decode(alone[: i + 1]) for i in range(len(alone))]
    full = pieces[-1]
    # the shortest stop string made of the end of token 5's text and the start of token 6's
    cut = len(pieces[4])
    stop = full[cut - 1 : cut + 2]
    assert len(stop) == 3
    engine = Engine(model, tok)
    (row,) = engine.submit([prompt], sp(40, stop=(stop,)))
    released: list[str] = []
    engine.run(lambda e: released.append(e.text))
    text = "".join(released)
    assert row.finish_reason == "stop" and text == full[: full.find(stop)]
    assert len(row.tokens) < 40 and stop not in text


def test_generation_limits_are_user_errors(run) -> None:
    from minillm.errors import UserError

    model = run[1].model
    with pytest.raises(ValueError, match="prompt of 65 tokens for a context of 64"):
        generate(model, [[1] * 65], sp(1))
    with pytest.raises(UserError, match="top-p"):
        SamplingParams(2, top_p=0.0).resolve(run[1].config.sample)
    with pytest.raises(ValueError, match="prompt of 0 tokens"):
        generate(model, [[]], sp(2))
    with pytest.raises(ValueError, match="resolve"):
        generate(model, [[1]], SamplingParams(2))


def test_a_prompt_samples_the_same_text_at_any_position_of_the_batch(run) -> None:
    model = run[1].model
    params = sp(15, 1.0, seed=3)
    first = generate(model, [PROMPTS[0], PROMPTS[1]], params)
    second = generate(model, [PROMPTS[1], PROMPTS[0]], params)
    assert first == second[::-1]
    # Repeats of one prompt are its samples 0, 1, ...: they differ, and keep their order.
    repeated = generate(model, [PROMPTS[1], PROMPTS[0], PROMPTS[1]], params)
    assert repeated[:2] == second and repeated[2] != repeated[0]
    assert repeated[2] == generate(model, [PROMPTS[1]], params, n=2)[1]
    assert row_seed(3, 1) != row_seed(3, 0)


@pytest.mark.parametrize(
    "n, window",
    [(1, 1), (64, 64), (65, 32), (66, 33), (97, 64), (98, 32), (130, 64), (131, 32)],
)
def test_window_length_table(n: int, window: int) -> None:
    assert window_length(n, 64) == window


@torch.inference_mode()
def greedy_by_full_forward(model, prompt: list[int], n: int, vocab: int | None = None) -> list[int]:
    """nanoGPT's way, without a cache: one forward of the row's window per new token."""
    text = list(prompt)
    for _ in range(n):
        w = window_length(len(text), model.cfg.max_seq_len)
        logits, _ = model(torch.tensor([text[-w:]]))
        text.append(int(logits[0, -1, :vocab].argmax()))
    return text[len(prompt) :]


def test_generation_slides_past_the_context_rows_stay_independent(run) -> None:
    # Row 0 outgrows the context while row 1 does not yet: only the sliding row is refilled,
    # and each equals nanoGPT's window-by-window forward.
    model = run[1].model  # max_seq_len 64
    prompts = [[5, 17, 42, 99, 7, 8, 120] * 7, [3]]  # 49 tokens and 1
    slides: list[int] = []
    engine = Engine(model, on_slide=lambda row: slides.append(len(row.prompt)))
    rows = engine.submit(prompts, sp(120))
    engine.run()
    assert [len(row.tokens) for row in rows] == [120, 120]
    assert slides[:2] == [49, 49] and slides.count(1) == 2  # row 0 slid first, twice
    for r, prompt in enumerate(prompts):
        assert rows[r].tokens == greedy_by_full_forward(model, prompt, 120), f"row {r}"
    params = sp(100, 0.8, seed=11)
    sampled = generate(model, prompts, params)
    assert [generate(model, [p], params)[0] for p in prompts] == sampled


def test_echo_logprobs_come_from_the_prefill_and_equal_eval(run) -> None:
    # The prompt's log-probabilities from the one prefill that fills the cache: the numbers a
    # full forward (what `minillm eval` computes) gives, and no second forward of the prompt.
    model = run[1].model
    prompt = PROMPTS[0]
    calls = []
    hook = model.register_forward_hook(lambda m, args, out: calls.append(args[0].shape))
    try:
        engine = Engine(model)
        (row,) = engine.submit([prompt], sp(3, logprobs=2, prompt_logprobs=2))
        events = []
        engine.run(events.append)
    finally:
        hook.remove()
    assert calls == [(1, len(prompt))]  # the prefill; the steps use the Decoder
    with torch.inference_mode():
        full = torch.log_softmax(model(torch.tensor([prompt]))[0][0], dim=-1)
    got = events[0].prompt
    assert got[0].logprob is None and [t.id for t in got] == prompt
    for t, info in enumerate(got[1:]):
        assert info.logprob == pytest.approx(float(full[t, prompt[t + 1]]), abs=1e-5)
        assert [i for i, _ in info.top] == full[t].topk(2).indices.tolist()
    assert [e.logprob.id for e in events] == row.tokens


# ----------------------------------------------------------------------------- streaming


def test_incremental_decoding_never_breaks_a_character() -> None:
    tok = tiny_tokenizer()
    text = "Grüße — 日本語 🙂🚀 and plain words"
    ids = tok.encode(text).ids
    assert len(ids) > len(text.split())  # characters really are split over byte tokens
    dec = TextStreamer(tok)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p) > 5  # it did stream


# ----------------------------------------------------------------------------- the CLI

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, ["sample", *args])


def test_cli_sample_streams_the_prompt_and_is_reproducible(run) -> None:
    run_dir, loaded = run
    args = ["--ckpt", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "12"]
    first = invoke(*args, "--seed", "5")
    assert first.exit_code == 0, first.output
    assert first.stdout.startswith("ROMEO:")
    assert invoke(*args, "--seed", "5").stdout == first.stdout
    greedy = invoke(*args, "--temperature", "0")
    tok = loaded.tokenizer
    eot = eot_id(tok)
    ids = [eot, *tok.encode("ROMEO:").ids]
    expected = generate(loaded.model, [ids], sp(12, stop_ids=frozenset([eot])))
    assert greedy.stdout == "ROMEO:" + tok.decode(expected[0]) + "\n"


def test_cli_sample_reports_its_speed_on_stderr_only(run) -> None:
    """One "N tokens in X s: Y tokens/s (prefill P ms)" line on stderr; stdout is the text alone."""
    run_dir, loaded = run
    args = ["--ckpt", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "12"]
    result = invoke(*args, "--temperature", "0", "--ignore-eos")
    assert result.exit_code == 0, result.output
    tok = loaded.tokenizer
    expected = generate(
        loaded.model,
        [[eot_id(tok), *tok.encode("ROMEO:").ids]],
        sp(12),
        vocab_limit=tok.get_vocab_size(),
    )
    assert result.stdout == "ROMEO:" + tok.decode(expected[0]) + "\n"
    lines = [line for line in result.stderr.splitlines() if "tokens/s" in line]
    assert len(lines) == 1, result.stderr
    match = re.fullmatch(
        r"(\d+) tokens in ([\d.]+) s: ([\d.]+) tokens/s \(prefill (\d+) ms\)", lines[0]
    )
    assert match, lines[0]
    assert int(match[1]) == 12 and float(match[3]) > 0


def test_cli_several_prompts_give_their_one_at_a_time_text(run) -> None:
    run_dir, _ = run
    common = ["--ckpt", str(run_dir), "--temperature", "0", "--max-new-tokens", "10"]
    both = invoke(*common, "--prompt", "The king", "--prompt", "日本 and", "--num-samples", "2")
    assert both.exit_code == 0, both.output
    blocks = both.stdout.split("\n" + "-" * 40 + "\n")
    assert len(blocks) == 4 and blocks[0] == blocks[1] and blocks[2] == blocks[3]
    for block, prompt in ((blocks[0], "The king"), (blocks[2], "日本 and")):
        alone = invoke(*common, "--prompt", prompt)
        assert alone.stdout.rstrip("\n") == block.rstrip("\n")


def test_cli_every_prompt_gets_max_new_tokens_and_its_own_text(run) -> None:
    run_dir, loaded = run
    tok = loaded.tokenizer
    common = ["--ckpt", str(run_dir), "--temperature", "0", "--max-new-tokens", "30"]
    common += ["--ignore-eos"]
    long = "Now is the winter of our discontent made glorious summer, by"  # 60 characters
    assert len(tok.encode(long).ids) > 20
    both = invoke(*common, "--prompt", "A", "--prompt", long)
    assert both.exit_code == 0, both.output
    blocks = both.stdout.split("\n" + "-" * 40 + "\n")
    alone = invoke(*common, "--prompt", "A").stdout
    assert blocks[0].rstrip("\n") == alone.rstrip("\n")
    ids = [eot_id(tok), *tok.encode("A").ids]
    expected = generate(loaded.model, [ids], sp(30), vocab_limit=tok.get_vocab_size())
    assert blocks[0].rstrip("\n") == "A" + tok.decode(expected[0]) and len(expected[0]) == 30
    assert "cut to" not in both.stderr


def test_cli_seeded_prompt_gives_the_same_sample_in_second_place(run) -> None:
    common = ["--ckpt", str(run[0]), "--seed", "9", "--max-new-tokens", "12", "--ignore-eos"]
    alone = invoke(*common, "--prompt", "ROMEO:", "--num-samples", "2")
    behind = invoke(*common, "--prompt", "JULIET:", "--prompt", "ROMEO:", "--num-samples", "2")
    assert alone.exit_code == behind.exit_code == 0, behind.output
    sep = "\n" + "-" * 40 + "\n"
    assert behind.stdout.split(sep)[2:] == alone.stdout.split(sep)


@pytest.mark.slow
def test_cli_generation_goes_past_the_context_with_one_note(run) -> None:
    run_dir, loaded = run
    tok = loaded.tokenizer
    args = ["--ckpt", str(run_dir), "--prompt", "ROMEO:", "--temperature", "0", "--ignore-eos"]
    result = invoke(*args, "--max-new-tokens", "150")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("sliding window") == 1 and "context of 64" in result.stderr
    prompt = [eot_id(tok), *tok.encode("ROMEO:").ids]
    expected = greedy_by_full_forward(loaded.model, prompt, 150, tok.get_vocab_size())
    assert result.stdout == "ROMEO:" + tok.decode(expected) + "\n"


def test_cli_without_prompt_starts_a_fresh_document_from_the_defaults(run) -> None:
    run_dir, _ = run
    result = invoke("--ckpt", str(run_dir), "--seed", "1")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", ""], "--prompt number 1 is empty"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--temperature", "-0.1"], "--temperature must be >= 0"),
        (["--top-k", "-1"], "--top-k must be >= 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--num-samples", "0"], "--num-samples must be >= 1"),
        (["--prompt", "to be or not " * 40], "the model's context is 64 tokens"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "no such prompt file"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(run, args: list[str], message: str) -> None:
    result = invoke("--ckpt", str(run[0]), *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_cli_path_that_is_no_run_is_one_line(tmp_path: Path) -> None:
    result = invoke("--ckpt", str(tmp_path), "--prompt", "x")
    assert result.exit_code == 2
    assert "not a minillm run directory" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("policy", ["PASSIVE", "ACTIVE"])
def test_one_row_steps_run_on_one_thread_while_openmp_threads_sleep(
    tiny_model_cfg: ModelConfig, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """Issue 49: under OMP_WAIT_POLICY=PASSIVE (minillm's default) each small op of a one-row
    step would wake the sleeping workers, so one-row steps run on one thread; several rows (and
    ACTIVE, spinning workers) keep torch's threads, restored after every step."""
    from minillm.infer import engine as engine_mod
    from minillm.model import Transformer
    from minillm.model.decode import Decoder

    monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    seen: list[tuple[int, int]] = []

    class Recording(Decoder):
        def step(self, tokens: torch.Tensor) -> torch.Tensor:
            seen.append((len(tokens), torch.get_num_threads()))
            return super().step(tokens)

    model = Transformer(tiny_model_cfg).eval()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        one = engine_mod.generate(model, [[1, 2, 3]], SamplingParams.greedy(4), decoder=Recording)
        assert torch.get_num_threads() == 2
        engine_mod.generate(model, [[1, 2], [4, 5, 6]], SamplingParams.greedy(4), decoder=Recording)
        alone = engine_mod.generate(model, [[1, 2, 3]], SamplingParams.greedy(4))
    finally:
        torch.set_num_threads(before)
    assert one == alone
    single = {t for n, t in seen if n == 1}
    several = {t for n, t in seen if n > 1}
    assert single == ({1} if policy == "PASSIVE" else {2}) and several == {2}


@pytest.mark.parametrize(
    "d_model, dtype, int8, threads",
    [
        (1024, torch.bfloat16, False, None),
        (1024, torch.float32, False, 1),
        (1024, torch.float32, True, None),
        (256, torch.bfloat16, False, 1),
    ],
)
def test_one_row_steps_of_large_half_precision_layers_keep_torch_threads(
    monkeypatch: pytest.MonkeyPatch,
    d_model: int,
    dtype: torch.dtype,
    int8: bool,
    threads: int | None,
) -> None:
    """Issue 60: torch's bf16 matrix-vector products are bound by arithmetic on a CPU without a
    bf16 dot, so a layer of >= 8M weights (here d 1024: 12.8M) steps on every thread even under
    PASSIVE (a 3B model's bf16 token took 0.72 s on one thread of two, 0.42 s on both); fp32
    layers of any size and small ones keep one thread (minillm.runtime.device.ALL_THREADS_FROM).
    int8's products (fbgemm) are arithmetic-bound too: 0.80-0.89x one thread's step at 1.1B in
    most runs (docs/benchmarks.md)."""
    from minillm.infer.engine import Engine
    from minillm.model import Transformer
    from minillm.model.decode import layer_weights

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    cfg = ModelConfig(
        vocab_size=64, d_model=d_model, n_layer=1, n_head=d_model // 64, n_kv_head=d_model // 64,
        max_seq_len=32,
    )  # fmt: skip
    model = Transformer(cfg).to(dtype).eval()
    assert layer_weights(cfg) == sum(p.numel() for p in model.blocks[0].parameters() if p.dim() > 1)
    if int8:
        from minillm.model.quantize import quantize_int8

        if (problem := quantize_int8(model)) is not None:
            pytest.skip(problem)
    assert Engine(model).step_threads == threads
