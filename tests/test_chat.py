"""Chat data: the template's ids, bad rows, the target mask, document-aware packing, resume."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from minillm.config import ModelConfig, config_from_dict
from minillm.data.batches import (
    MicroBatch,
    conversation_batches,
    doc_ids,
    doc_starts,
    train_batch,
)
from minillm.data.meta import load_meta, open_mask, open_split
from minillm.data.tokenize_pass import write_shards
from minillm.errors import ConfigError, UserError
from minillm.model import Transformer
from minillm.tokenizer.bpe import load_tokenizer
from minillm.tokenizer.chat_template import chat_ids, check_messages, encode_conversation
from minillm.tokenizer.conventions import Conventions
from tests.helpers import assert_same_function, make_trainer

SUM = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


def chat_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Tiny additions as conversations; every third has a system message."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        messages = [{"role": "user", "content": f"What is {a} plus {b}?"}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "You add numbers."})
        messages.append({"role": "assistant", "content": f"{a} + {b} = {a + b}"})
        rows.append({"messages": messages})
    return rows


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def chat_config(tmp_path: Path, rows: list[Any] | None = None, **sections: dict[str, Any]):
    src = write_jsonl(tmp_path / "chat.jsonl", rows if rows is not None else chat_rows(120))
    raw: dict[str, dict[str, Any]] = {
        "model": dict(d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=64, max_seq_len=64),
        "data": dict(
            source=str(src), text_field="messages", vocab_size=300, out_dir=str(tmp_path / "tok")
        ),
        "train": dict(
            out_dir=str(tmp_path / "run"), batch_size=4, seq_len=48, max_steps=6, lr=1e-2,
            min_lr=1e-3, warmup_steps=2, eval_every=3, eval_steps=2, ckpt_every=3, log_every=2,
            device="cpu", precision="fp32",
        ),
    }  # fmt: skip
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenized chat shards shared by this module's tests (they only read them)."""
    base = tmp_path_factory.mktemp("chat")
    write_shards(chat_config(base))
    return base


def test_template_ids_of_a_known_conversation(chat_dir: Path) -> None:
    tok = load_tokenizer(chat_dir / "tok" / "tokenizer.json")
    ids = chat_ids(tok)
    assert [ids[k] for k in ("system", "user", "assistant", "end")] == [
        tok.token_to_id(t) for t in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    ]
    q, a = tok.encode("2+2?").ids, tok.encode("4").ids
    got, target = encode_conversation(tok, SUM)
    assert got == [ids["user"], *q, ids["end"], ids["assistant"], *a, ids["end"]]
    # Targets: the assistant content and its <|end|>, nothing of the user's turn.
    assert target == [False] * (len(q) + 3) + [True] * (len(a) + 1)
    prompt = Conventions.of_own(tok).chat_ids(SUM[:1], add_generation_prompt=True)
    assert prompt == [ids["user"], *q, ids["end"], ids["assistant"]]
    # A quoted special token in a content is text, not a turn.
    quoted, _ = encode_conversation(tok, [{"role": "user", "content": "<|end|>"}])
    assert quoted.count(ids["end"]) == 1


@pytest.mark.parametrize(
    "row, what",
    [
        ([{"role": "bot", "content": "hi"}], r"messages\[0\]\.role: 'bot' is not one of"),
        ([{"role": "user", "content": 5}, *SUM], r"messages\[0\]\.content: expected a string"),
        ([{"role": "user", "content": "hi"}], r"messages: no assistant turn"),
    ],
)
def test_a_bad_row_is_one_error_naming_file_row_and_field(row: list, what: str) -> None:
    with pytest.raises(ConfigError, match=f"^x.jsonl: data.text_field: row 7: {what}"):
        check_messages(row, "x.jsonl", 7)


def test_a_bad_row_in_a_chat_file_stops_tokenize(tmp_path: Path) -> None:
    rows = chat_rows(10)
    rows[4]["messages"][0]["role"] = "narrator"
    cfg = chat_config(tmp_path, rows)
    with pytest.raises(ConfigError, match=r"chat.jsonl: data.text_field: line 5: messages\[0\]"):
        write_shards(cfg)
    assert not (tmp_path / "tok" / "meta.json").exists()


def test_shards_keep_the_mask_and_meta_counts_the_targets(chat_dir: Path) -> None:
    out = chat_dir / "tok"
    meta = load_meta(out)
    assert meta["chat"] and meta["loss_on"] == "assistant"
    tok = load_tokenizer(out / "tokenizer.json")
    for split in ("train", "val"):
        tokens, mask = open_split(out, split), open_mask(out, split, meta)
        assert mask is not None and len(mask) == len(tokens)
        assert meta[split]["targets"] == int(mask.sum()) < meta[split]["tokens"]
        # Every target is an assistant token or <|end|>; the first conversation, exactly.
        first = doc_starts(tokens, meta["eot_id"])[1]
        rows = [json.loads(r) for r in (chat_dir / "chat.jsonl").read_text().splitlines()]
        ids = tokens[:first].tolist()
        want_ids, want_target = encode_conversation(
            tok,
            next(
                r["messages"]
                for r in rows
                if encode_conversation(tok, r["messages"])[0] == ids[:-1]
            ),
        )
        assert mask[:first].tolist() == [*want_target, False]
        assert want_ids == ids[:-1]


def test_plain_text_shards_have_no_mask_and_loss_on_assistant_needs_chat(tmp_path: Path) -> None:
    src = tmp_path / "t.txt"
    src.write_text(" ".join(f"word{i} text{i * 7}" for i in range(2000)), encoding="utf-8")
    cfg = chat_config(tmp_path, data=dict(source=str(src), text_field="text"))
    write_shards(cfg)
    meta = load_meta(cfg.data.out_dir)
    assert open_mask(cfg.data.out_dir, "train", meta) is None
    assert meta["train"]["targets"] == meta["train"]["tokens"]
    cfg.data.loss_on = "assistant"
    with pytest.raises(ConfigError, match="data.loss_on: assistant needs chat data"):
        write_shards(cfg)


def test_loss_is_over_assistant_tokens_only(chat_dir: Path) -> None:
    """User/system positions get no gradient; the loss is the mean over assistant targets."""
    out = chat_dir / "tok"
    meta = load_meta(out)
    tokens, mask = open_split(out, "train"), open_mask(out, "train", meta)
    (x, y, _), = train_batch(tokens, seed=1, step=0, rank=0, world_size=1, batch_size=4,
                             grad_accum=1, seq_len=48, mask=mask)  # fmt: skip
    assert 0 < int((y != -100).sum()) < y.numel()
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(vocab_size=300, d_model=32, n_layer=1, n_head=2, max_seq_len=64)
    )
    logits, loss = model(x, y)
    logits.retain_grad()
    loss.backward()
    ignored = y == -100
    assert torch.all(logits.grad[ignored] == 0) and torch.all(
        logits.grad[~ignored].abs().sum(-1) > 0
    )
    logp = torch.log_softmax(logits.detach().double(), dim=-1)
    by_hand = -logp[~ignored, y[~ignored]].mean()
    assert_same_function(loss.double(), by_hand)
    # The ignored targets are exactly the non-assistant tokens of the windows.
    assert torch.equal(ignored, ~torch.from_numpy(np.stack([
        np.asarray(mask[o + 1 : o + 49]) for o in _offsets(tokens, 1, 0, 4, 48)
    ])))  # fmt: skip


def _offsets(tokens: np.ndarray, seed: int, step: int, windows: int, seq_len: int) -> np.ndarray:
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, len(tokens) - seq_len - 1, size=windows, endpoint=True)


def test_doc_mask_keeps_documents_apart() -> None:
    """Perturbing one packed document leaves another's logits unchanged (and equal to alone)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, max_seq_len=32))
    model.eval()
    eot = 0
    first, second = [5, 6, 7, 8, eot], [9, 10, 11, 12, 13, eot]
    x = torch.tensor([first + second])  # (1, 11)
    docs = doc_ids(x, eot)
    assert docs.tolist() == [[0] * 5 + [1] * 6]
    logits, _ = model(x, doc_ids=docs)
    perturbed = x.clone()
    perturbed[0, :4] = torch.tensor([20, 21, 22, 23])
    again, _ = model(perturbed, doc_ids=doc_ids(perturbed, eot))
    torch.testing.assert_close(logits[0, 5:], again[0, 5:], rtol=0, atol=0)
    alone, _ = model(torch.tensor([second]))
    assert_same_function(logits[0, 5:], alone[0])
    without, _ = model(perturbed)  # plain causal attention does see the other document
    assert not torch.allclose(logits[0, 5:], without[0, 5:])


def test_chat_windows_start_at_a_conversation_and_eval_scores_each_alone(chat_dir: Path) -> None:
    out = chat_dir / "tok"
    meta = load_meta(out)
    tokens, mask, eot = open_split(out, "train"), open_mask(out, "train", meta), meta["eot_id"]
    starts = doc_starts(tokens, eot)
    tok = load_tokenizer(out / "tokenizer.json")
    role_ids = set(chat_ids(tok).values())
    kw = dict(rank=0, world_size=1, batch_size=4, grad_accum=2, seq_len=48)
    batches = train_batch(tokens, seed=3, step=5, mask=mask, eot_id=eot, starts=starts, **kw)
    for x, _, docs in batches:
        assert all(int(t) in role_ids for t in x[:, 0])  # a window opens with a role token
        assert torch.equal(docs, doc_ids(x, eot))
    rows = list(conversation_batches(tokens, mask, eot, seq_len=48, batch_size=8))
    n_rows = sum(len(x) for x, _ in rows)
    assert n_rows == len(starts)
    x, y = rows[0]
    last = int((y[0] != -100).nonzero().max())  # the final <|end|> of the first conversation
    assert eot not in x[0, : last + 1].tolist() and (y[0, last + 1 :] == -100).all()


def test_trainer_on_chat_resumes_bitwise_with_doc_mask(chat_dir: Path, tmp_path: Path) -> None:
    from tests.helpers import assert_same_weights, resumed_runs

    straight, _, resumed = resumed_runs(chat_config(chat_dir), tmp_path, stop_at=2)
    packing = straight.objective.packing
    assert packing.doc_mask and packing.starts is not None
    assert_same_weights(straight, resumed)


def test_a_tokenizer_without_chat_tokens_is_refused() -> None:
    from tokenizers import Tokenizer, models

    with pytest.raises(UserError, match="has no chat tokens"):
        chat_ids(Tokenizer(models.BPE()), "x")


@pytest.mark.slow  # a pretraining run, then a fine-tuning one
def test_fine_tune_from_a_minillm_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """init_from a run: its model, weights and tokenizer; differing keys are named."""
    import yaml

    from minillm.checkpoint import layout
    from minillm.checkpoint import store as ckpt
    from minillm.checkpoint.init_from import load_run_config
    from tests.helpers import prepared_config

    (tmp_path / "pre").mkdir()
    pre = prepared_config(tmp_path / "pre", train=dict(max_steps=2, eval_every=0))
    first = make_trainer(pre, verbose=False)
    try:
        first.fit()
    finally:
        first.close()
    run_dir = Path(pre.train.out_dir)

    base = chat_config(tmp_path)  # writes chat.jsonl; the YAML below leaves model out
    raw = {
        "data": {"source": base.data.source, "text_field": "messages",
                 "out_dir": str(tmp_path / "chat_tok")},  # vocab_size: the run's
        "train": {"init_from": str(run_dir), "out_dir": str(tmp_path / "sft"), "seq_len": 32,
                  "batch_size": 2, "max_steps": 2, "warmup_steps": 1, "eval_every": 0,
                  "device": "cpu", "precision": "fp32"},
    }  # fmt: skip
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    cfg = load_run_config(path)
    assert cfg.model == pre.model
    assert Path(cfg.data.tokenizer) == run_dir / "tokenizer.json"  # the run's vocabulary
    write_shards(cfg)
    trainer = make_trainer(cfg, verbose=False)
    try:
        start = ckpt.load_model_state(layout.resolve_checkpoint(run_dir))
        for name, value in trainer.model.state_dict().items():
            assert torch.equal(value, start[name]), name
        trainer.fit()
    finally:
        trainer.close()

    raw["model"] = {"d_model": 32, "n_layer": 1, "n_head": 4, "max_seq_len": 64}
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    other = load_run_config(path)
    other.train.out_dir = str(tmp_path / "sft2")
    make_trainer(other, verbose=False).close()
    assert "model.n_layer" in capsys.readouterr().err  # the warning names the keys not used

    # A config naming another tokenizer than the run's: one error naming data.tokenizer, where
    # the config is read (init_from is resolved there, once).
    (tmp_path / "own").mkdir()
    own = chat_config(tmp_path / "own")
    write_shards(own)
    raw["data"]["tokenizer"] = str(own.data.tokenizer_path)
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    with pytest.raises(ConfigError, match="data.tokenizer: .*another tokenizer than train.init"):
        load_run_config(path)


def test_accumulation_with_doc_mask_equals_one_big_batch(chat_dir: Path, tmp_path: Path) -> None:
    """Token-weighted over the assistant targets: 2 micro-batches give the big batch's gradient."""
    out = chat_dir / "tok"
    meta = load_meta(out)
    tokens, mask, eot = open_split(out, "train"), open_mask(out, "train", meta), meta["eot_id"]
    kw = dict(seed=0, step=0, rank=0, world_size=1, seq_len=48, mask=mask, eot_id=eot)
    (big,) = train_batch(tokens, batch_size=4, grad_accum=1, starts=doc_starts(tokens, eot), **kw)
    x, y, docs = big
    assert len({int((y[r] != -100).sum()) for r in range(4)}) > 1  # uneven targets per row

    def grads(run: str, micro: list, **train: Any) -> dict[str, torch.Tensor]:
        cfg = chat_config(chat_dir, train=dict(out_dir=str(tmp_path / run), **train))
        trainer = make_trainer(cfg, verbose=False, batches=lambda step: micro)
        captured: dict[str, torch.Tensor] = {}
        trainer.optimizer.step = lambda *a, **k: captured.update(
            {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        )
        try:
            trainer.train_step()
        finally:
            trainer.close()
        return captured

    halves = [MicroBatch(x[:2], y[:2], docs[:2]), MicroBatch(x[2:], y[2:], docs[2:])]
    split = grads("a", halves, grad_accum=2, batch_size=2)
    whole = grads("b", [MicroBatch(x, y, docs)], grad_accum=1, batch_size=4)
    for name in whole:
        assert_same_function(split[name], whole[name])
