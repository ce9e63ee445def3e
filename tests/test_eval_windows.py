"""`minillm eval`'s windows (issue 41, item 6): the last window is forwarded at its own length,
never padded to the context; a text shorter than the context is one forward of its length (a
Hugging Face folder's loss is then transformers' `model(ids, labels=ids).loss`); `--seq-len N`
chooses the window, up to the model's context; a run's windows are unchanged where the text fills
them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.data.batches import eval_batches
from minillm.infer.evaluate import evaluate_checkpoint, evaluate_tokens
from tests.helpers import error_line, make_run, tiny_tokenizer
from tests.test_evaluate import hand_nll
from tests.test_hf_ckpt import CONTEXT, TEXT, hf_loss, llama_folder

runner = CliRunner()


class Recorder(torch.nn.Module):
    """The model, recording the (inputs, targets) of every forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor, **kw) -> tuple:
        self.calls.append((x.clone(), y.clone()))
        return self.model(x, y, **kw)


@pytest.mark.parametrize(
    "length, batch_size, shapes",
    [(50, 3, [(3, 16), (1, 1)]), (40, 3, [(2, 16), (1, 7)]), (12, 8, [(1, 11)])],
)
def test_the_last_window_is_forwarded_at_its_length(
    tmp_path: Path, length: int, batch_size: int, shapes: list[tuple[int, int]]
) -> None:
    _, _, model = make_run(tmp_path)
    ids = torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(length))
    rec = Recorder(model)
    total, n = evaluate_tokens(rec, ids, seq_len=16, batch_size=batch_size)
    assert [tuple(x.shape) for x, _ in rec.calls] == shapes
    assert all(bool((y != -100).all()) for _, y in rec.calls)  # no padding anywhere
    ref_total, ref_n = hand_nll(model, ids.tolist(), 16)
    assert n == ref_n == length - 1
    assert total == pytest.approx(ref_total, rel=1e-6)


def test_a_run_whose_text_fills_the_windows_is_scored_as_before(tmp_path: Path) -> None:
    """The forwards are eval_batches' own, so the sum is bit for bit the padded code's."""
    _, _, model = make_run(tmp_path)
    ids = torch.randint(0, 300, (16 * 7 + 1,), generator=torch.Generator().manual_seed(1))
    rec = Recorder(model)
    total, n = evaluate_tokens(rec, ids, seq_len=16, batch_size=3)
    before = list(eval_batches(ids.numpy(), seq_len=16, batch_size=3))
    assert len(rec.calls) == len(before) == 3
    for (x, y), (bx, by) in zip(rec.calls, before, strict=True):
        assert torch.equal(x, bx) and torch.equal(y, by)
    with torch.no_grad():
        want = sum(model(x, y, reduction="sum")[1].double() for x, y in before)
    assert (total, n) == (float(want), 16 * 7)


def test_a_folder_scores_a_short_text_as_transformers_does(tmp_path: Path) -> None:
    """A text shorter than the context: one window of its length, transformers' loss."""
    folder, hf = llama_folder(tmp_path)
    tok = tiny_tokenizer()
    text = TEXT[:80]
    ids = tok.encode(text, add_special_tokens=False).ids
    assert 2 < len(ids) < CONTEXT
    data = tmp_path / "short.txt"
    data.write_text(text, encoding="utf-8")
    loaded = load_checkpoint(folder)
    rec = Recorder(loaded.model)
    loaded.model = rec
    got = evaluate_checkpoint(loaded, data=data)
    assert [tuple(x.shape) for x, _ in rec.calls] == [(1, len(ids) - 1)]
    assert got["seq_len"] == got["tokens"] == len(ids) - 1
    x = torch.tensor([ids])
    with torch.no_grad():
        want = hf(x, labels=x).loss.item()
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    human = runner.invoke(app, ["eval", "--ckpt", str(folder), "--data", str(data)])
    assert f"context {len(ids) - 1}," in human.stdout, human.output


def test_seq_len_chooses_the_windows(tmp_path: Path) -> None:
    folder, hf = llama_folder(tmp_path)
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    tok = tiny_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    args = ["eval", "--ckpt", str(folder), "--data", str(data), "--json", "--seq-len", "16"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    with torch.no_grad():
        want, n = hand_nll(hf, ids, 16)  # HF output[0]: the logits
    assert got["tokens"] == n == len(ids) - 1
    assert got["loss"] == pytest.approx(want / n, rel=1e-5)
    # The default is the folder's context, another number on the same text.
    default, _ = hf_loss(hf, ids)
    assert not math.isclose(default, got["loss"], rel_tol=1e-4)
    # A run: up to model.max_seq_len, past its train.seq_len (16).
    run_dir, cfg, model = make_run(tmp_path / "r")
    run_ids = ids[:100]
    loaded = load_checkpoint(run_dir)
    (tmp_path / "r" / "t.txt").write_text(tok.decode(run_ids), encoding="utf-8")
    for seq_len in (5, cfg.model.max_seq_len):
        got = evaluate_checkpoint(loaded, data=tmp_path / "r" / "t.txt", seq_len=seq_len)
        file_ids = tok.encode(tok.decode(run_ids), add_special_tokens=False).ids
        total, n = hand_nll(model, file_ids, seq_len)
        assert got["tokens"] == n and got["seq_len"] == min(seq_len, n)
        assert got["loss"] == pytest.approx(total / n, rel=1e-6)


def test_seq_len_past_the_models_context_extrapolates_and_bad_values_are_one_line(
    tmp_path: Path,
) -> None:
    """Past the context the windows are N long (plain RoPE extrapolates: the context is raised
    to N, issue 42's context extension measures this); 0 and --task alone are refused."""
    folder, _ = llama_folder(tmp_path)
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    args = ["eval", "--ckpt", str(folder), "--data", str(data)]
    result = runner.invoke(app, [*args, "--seq-len", str(CONTEXT + 1)])
    assert result.exit_code == 0, result.output
    assert f"context {CONTEXT + 1}," in result.stdout
    line = error_line(runner.invoke(app, [*args, "--seq-len", "0"]))
    assert line == "error: --seq-len: must be >= 1, got 0"
    task = tmp_path / "t.jsonl"
    task.write_text(json.dumps({"context": "a", "endings": ["b", "c"], "label": 0}) + "\n")
    line = error_line(
        runner.invoke(app, ["eval", "--ckpt", str(folder), "--task", str(task), "--seq-len", "8"])
    )
    assert line.startswith("error: --seq-len: ") and "--data" in line


def test_seq_len_names_the_rope_scaling_that_sets_the_context(tmp_path: Path) -> None:
    run_dir, cfg, _ = make_run(tmp_path, model={"rope_scaling": {"type": "linear", "factor": 2.0}})
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    context = cfg.model.max_seq_len
    args = ["eval", "--ckpt", str(run_dir), "--data", str(tmp_path / "t.txt")]
    # The context kept at its own length (--set model.max_seq_len): a longer window is refused.
    keep = ["--set", f"model.max_seq_len={context}"]
    line = error_line(runner.invoke(app, [*args, *keep, "--seq-len", str(context + 1)]))
    assert line == (
        f"error: --seq-len: {context + 1} exceeds the model's context of {context} tokens "
        f"(model.max_seq_len, with its linear RoPE scaling); pass at most {context}"
    )


@pytest.mark.slow
def test_bench_eval_prints_both_rows(monkeypatch, capsys) -> None:  # noqa: ANN001
    from tests.helpers import load_script

    bench = load_script("bench_eval", monkeypatch)
    rows = bench.main(["--layers", "1", "--tokens", "64", "--repeats", "1", "--threads", "0"])
    by_row = {r["row"]: r for r in rows}
    assert by_row["minillm eval"]["loss"] == pytest.approx(by_row["transformers"]["loss"], rel=1e-5)
    out = capsys.readouterr().out
    assert "| transformers |" in out and "| minillm eval |" in out


def test_a_short_text_under_dynamic_ntk_is_transformers_loss(tmp_path: Path) -> None:
    """Issue 50, defect 3: dynamic NTK's scaling depends on the forward's length, so a text
    shorter than the context is one forward of all its tokens, as transformers'
    model(ids, labels=ids) is (not of ids[:-1]): past the original length the two differ."""
    from minillm.checkpoint.hf_export import hf_config_dict
    from minillm.config import ModelConfig
    from tests.helpers import spread_weights_

    tok = tiny_tokenizer()
    eot = tok.token_to_id("<|endoftext|>")
    cfg = ModelConfig(vocab_size=tok.get_vocab_size() + 20, d_model=64, n_layer=2, n_head=4,
                      n_kv_head=2, ffn_hidden=96, max_seq_len=64, rope_theta=500.0,
                      rope_scaling={"type": "dynamic", "factor": 4.0,
                                    "original_max_position_embeddings": 16})  # fmt: skip
    hf_cfg = hf_config_dict(cfg, bos_id=eot, eos_id=eot)
    for key in ("architectures", "model_type", "torch_dtype"):
        hf_cfg.pop(key, None)
    torch.manual_seed(3)
    import transformers

    hf = spread_weights_(transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg)).eval())
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    text = TEXT[:60]
    ids = tok.encode(text, add_special_tokens=False).ids
    assert 16 < len(ids) < 64  # past the original length, inside the context
    data = tmp_path / "short.txt"
    data.write_text(text, encoding="utf-8")
    got = evaluate_checkpoint(load_checkpoint(folder), data=data)
    x = torch.tensor([ids])
    # Fresh models each: transformers' dynamic NTK keeps the longest length it has seen.
    fresh = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want = hf(x, labels=x).loss.item()
        shorter = fresh(x[:, :-1], labels=x[:, 1:], shift_labels=x[:, 1:]).loss.item()
    assert abs(shorter - want) > 1e-6 * abs(want)  # the case tells the two forwards apart
    assert got["loss"] == pytest.approx(want, rel=1e-6, abs=0)
