"""Every kind of bad input across the CLI: exit code 2, one `error:` line naming the file, key or
value at fault, no traceback, and not one byte of the run or its data changed."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.cli import app
from tests.helpers import trained_run

runner = CliRunner()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenized corpus, a 4-step run with checkpoints, and its config as a YAML file."""
    return trained_run(tmp_path_factory.mktemp("bad"))


def tree_hash(*roots: Path) -> dict[str, str]:
    """sha256 of every file below the roots (the lock file's holder line aside)."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_file() and p.name != "train.lock":
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def ckpt(world: Path, step: int = 4) -> Path:
    return world / "run" / "checkpoints" / f"step_{step:06d}"


# Each case: (id, setup(world, tmp) -> argv, text the error line must contain).
Case = tuple[str, Callable[[Path, Path], list[str]], str]


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path


def cfg_with(world: Path, tmp: Path, **sections: dict) -> str:
    """The world's config with some keys changed, written to tmp/cfg.yaml."""
    import yaml

    raw = yaml.safe_load((world / "cfg.yaml").read_text())
    for section, values in sections.items():
        raw[section].update(values)
    return str(write(tmp / "cfg.yaml", yaml.safe_dump(raw)))


def corrupt_copy(world: Path, tmp: Path, damage: Callable[[Path], None]) -> str:
    """A copy of the last checkpoint with `damage` applied to it."""
    import shutil

    dst = tmp / "ckpt"
    shutil.copytree(ckpt(world), dst)
    damage(dst)
    return str(dst)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def foreign_weights(ck: Path) -> None:
    """A valid safetensors file of another model, with state.json's hash updated to match."""
    import torch
    from safetensors.torch import save_file

    save_file({"transformer.wte.weight": torch.zeros(4, 4)}, str(ck / "model.safetensors"))
    state = json.loads((ck / "state.json").read_text())
    digest = hashlib.sha256((ck / "model.safetensors").read_bytes()).hexdigest()
    state["files"]["model.safetensors"] = digest
    (ck / "state.json").write_text(json.dumps(state))


def hf_folder(tmp: Path, config: dict | None) -> str:
    folder = tmp / "hf"
    folder.mkdir()
    if config is not None:
        write(folder / "config.json", json.dumps(config))
    return str(folder)


def pickle_bomb(ck: Path) -> None:
    class Evil:
        def __reduce__(self):  # runs os.system on unpickling
            return (os.system, (f"touch {ck}/PWNED",))

    with open(ck / "trainer_state.pt", "wb") as f:
        pickle.dump({"optimizer": Evil()}, f)
    state = json.loads((ck / "state.json").read_text())
    digest = hashlib.sha256((ck / "trainer_state.pt").read_bytes()).hexdigest()
    state["files"]["trainer_state.pt"] = digest
    (ck / "state.json").write_text(json.dumps(state))


def c(world: Path, tmp: Path) -> str:
    return str(world / "cfg.yaml")


CASES: list[Case] = [
    # --- the config, through info / train / tokenize
    ("yaml-malformed", lambda w, t: ["info", str(write(t / "a.yaml", "model: {d_model: [64\n"))],
     "invalid YAML"),
    ("config-missing", lambda w, t: ["info", str(t / "nope.yaml")], "no such config file"),
    ("unknown-key", lambda w, t: ["train", c(w, t), "--set", "train.learning_rate=1"],
     "train.learning_rate: unknown key"),
    ("unknown-section", lambda w, t: ["info", c(w, t), "--set", "optim.lr=1"], "optim.lr"),
    ("wrong-type", lambda w, t: ["train", c(w, t), "--set", "train.lr=fast"],
     "train.lr: expected a number"),
    ("wrong-type-bool", lambda w, t: ["train", c(w, t), "--set", "train.compile=maybe"],
     "train.compile"),
    ("negative-size", lambda w, t: ["train", c(w, t), "--set", "model.d_model=-32"],
     "model.d_model: must be > 0"),
    ("zero-layers", lambda w, t: ["info", c(w, t), "--set", "model.n_layer=0"],
     "model.n_layer: must be > 0"),
    ("zero-batch", lambda w, t: ["train", c(w, t), "--set", "train.batch_size=0"],
     "train.batch_size"),
    # A resolved config carries head_dim (8): with it given, 5 heads of 8 are a valid shape.
    ("heads-not-dividing", lambda w, t: ["train", c(w, t), "--set", "model.n_head=5", "--set",
                                         "model.head_dim=null"], "model.n_head: 5 does not divide"),
    ("kv-heads-not-dividing", lambda w, t: ["info", c(w, t), "--set", "model.n_kv_head=3"],
     "model.n_kv_head"),
    ("seq-len-too-long", lambda w, t: ["train", c(w, t), "--set", "train.seq_len=128"],
     "train.seq_len: 128 exceeds model.max_seq_len=64"),
    ("vocab-smaller-than-tokenizer", lambda w, t: ["train", c(w, t), "--set",
                                                   "model.vocab_size=200"], "model.vocab_size"),
    ("bad-precision", lambda w, t: ["train", c(w, t), "--set", "train.precision=fp8"],
     "train.precision"),
    ("cuda-absent", lambda w, t: ["train", c(w, t), "--set", "train.device=cuda"],
     "train.device"),
    ("device-garbled", lambda w, t: ["train", c(w, t), "--set", "train.device=cuda:x"],
     "train.device: unknown device"),
    ("lr-nan", lambda w, t: ["train", c(w, t), "--set", "train.lr=nan"], "train.lr"),
    ("eval-device-unknown", lambda w, t: ["eval", "--ckpt", str(w / "run"), "--device", "foo"],
     "--device: unknown device 'foo'"),
    ("sample-device-empty", lambda w, t: ["sample", "--ckpt", str(w / "run"), "--device", ""],
     "--device"),
    # --- data
    ("corpus-missing", lambda w, t: ["tokenize", cfg_with(w, t, data=dict(
        source=str(t / "missing.txt"), out_dir=str(t / "tok")))], "missing.txt"),
    ("corpus-empty", lambda w, t: ["tokenize", cfg_with(w, t, data=dict(
        source=str(write(t / "empty.txt", "")), out_dir=str(t / "tok")))], "empty.txt"),
    ("jsonl-broken-row", lambda w, t: ["tokenize", cfg_with(w, t, data=dict(
        source=str(write(t / "b.jsonl", '{"text": "fine"}\n' * 30 + '{"text": "bro\n')),
        out_dir=str(t / "tok")))], "b.jsonl: data.source: line 31: not JSON"),
    ("corpus-one-short-row", lambda w, t: ["tokenize", cfg_with(w, t, data=dict(
        source=str(write(t / "one.jsonl", '{"text": "abc def ghi"}\n')),
        out_dir=str(t / "tok")))], "one row, too short to split"),
    ("train-split-empty", lambda w, t: ["tokenize", cfg_with(w, t, data=dict(
        source=str(write(t / "two.jsonl", '{"text": ""}\n{"text": "abc def ghi jkl mno pqr"}\n')),
        out_dir=str(t / "tok")))], "no text in the train split"),
    ("corpus-binary", lambda w, t: ["tokenize", cfg_with(w, t, data=dict(
        source=str(write(t / "bin.txt", b"ok\n\xff\xfe\x00\x81 binary")),
        out_dir=str(t / "tok")))], "bin.txt"),
    ("text-field-unknown", lambda w, t: ["tokenize", cfg_with(w, t, data=dict(
        source=str(write(t / "d.jsonl", '{"body": "hello"}\n{"body": "world"}\n')),
        text_field="text", out_dir=str(t / "tok")))], "body"),
    ("vocab-too-small", lambda w, t: ["tokenize", cfg_with(w, t, data=dict(
        vocab_size=100, out_dir=str(t / "tok"), tokenizer=str(t / "tok" / "tokenizer.json")))],
     "data.vocab_size"),
    ("out-dir-not-writable", lambda w, t: ["tokenize", cfg_with(w, t, data=dict(
        out_dir=str(write(t / "a-file", "x") / "sub")))], "a-file"),
    ("tokenizer-differs", lambda w, t: ["tokenize", cfg_with(w, t, data=dict(vocab_size=280),
                                                             model=dict(vocab_size=300))],
     "vocab"),
    ("no-shards-yet", lambda w, t: ["train", cfg_with(w, t, data=dict(
        out_dir=str(t / "never"), tokenizer=str(w / "tokens" / "tokenizer.json")))], "tokenize"),
    # --- training runs
    ("run-dir-not-writable", lambda w, t: ["train", cfg_with(w, t, train=dict(
        out_dir=str(write(t / "b-file", "x") / "run")))], "b-file"),
    ("resume-other-architecture", lambda w, t: ["train", c(w, t), "--set", "model.n_layer=3",
                                                "--set", "train.max_steps=8"], "model.n_layer"),
    ("no-resume-without-force", lambda w, t: ["train", c(w, t), "--no-resume"], "--force"),
    ("init-from-not-llama", lambda w, t: ["train", cfg_with(w, t, train=dict(
        out_dir=str(t / "r"), init_from=hf_folder(t, {"model_type": "gpt2",
                                                      "architectures": ["GPT2LMHeadModel"]})))],
     "gpt2"),
    ("init-from-no-config", lambda w, t: ["train", cfg_with(w, t, train=dict(
        out_dir=str(t / "r"), init_from=hf_folder(t, None)))], "config.json"),
    # --- checkpoints
    ("ckpt-missing", lambda w, t: ["eval", "--ckpt", str(t / "nowhere")], "nowhere"),
    ("ckpt-not-a-run", lambda w, t: ["sample", "--ckpt", str(t)], "not a minillm run"),
    ("ckpt-truncated-weights", lambda w, t: ["eval", "--ckpt", corrupt_copy(
        w, t, lambda ck: truncate(ck / "model.safetensors"))], "model.safetensors"),
    ("ckpt-foreign-weights", lambda w, t: ["export", "--ckpt", corrupt_copy(
        w, t, foreign_weights), "--out", str(t / "out")], "transformer.wte.weight"),
    ("ckpt-garbled-state", lambda w, t: ["eval", "--ckpt", corrupt_copy(
        w, t, lambda ck: (ck / "state.json").write_text("{not json"))], "state.json"),
    ("trainer-state-pickle", lambda w, t: ["train", cfg_with(w, t, train=dict(
        out_dir=str(_run_with(w, t, pickle_bomb)), max_steps=8))], "trainer_state.pt"),
    # --- eval / sample / export options
    ("eval-data-missing", lambda w, t: ["eval", "--ckpt", str(w / "run"), "--data",
                                        str(t / "none.txt")], "none.txt"),
    ("sample-empty-prompt", lambda w, t: ["sample", "--ckpt", str(w / "run"), "--prompt", ""],
     "prompt"),
    ("sample-top-p-zero", lambda w, t: ["sample", "--ckpt", str(w / "run"), "--top-p", "0"],
     "top-p"),
    ("sample-top-p-above-one", lambda w, t: ["sample", "--ckpt", str(w / "run"), "--top-p",
                                             "1.5"], "top-p"),
    ("sample-negative-temperature", lambda w, t: ["sample", "--ckpt", str(w / "run"),
                                                  "--temperature", "-1"], "temperature"),
    ("sample-negative-top-k", lambda w, t: ["sample", "--ckpt", str(w / "run"), "--top-k", "-3"],
     "top-k"),
    ("sample-zero-new-tokens", lambda w, t: ["sample", "--ckpt", str(w / "run"),
                                             "--max-new-tokens", "0"], "max-new-tokens"),
    ("export-out-not-empty", lambda w, t: ["export", "--ckpt", str(w / "run"), "--out",
                                           str(write(t / "full" / "x.txt", "x").parent)], "full"),
]  # fmt: skip


def _run_with(world: Path, tmp: Path, damage: Callable[[Path], None]) -> Path:
    """A copy of the whole run whose latest checkpoint has `damage` applied (and is LATEST)."""
    import shutil

    dst = tmp / "run-copy"
    shutil.copytree(world / "run", dst)
    damage(dst / "checkpoints" / "step_000004")
    for older in (dst / "checkpoints").glob("step_00000[0-3]"):
        shutil.rmtree(older)  # no intact older checkpoint to fall back to
    return dst


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_bad_input_gives_one_clear_line_and_changes_nothing(
    world: Path, tmp_path: Path, case: Case
) -> None:
    _, setup, expected = case
    argv = setup(world, tmp_path)
    before = tree_hash(world)
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, (argv, result.output, result.exception)
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    others = [line for line in lines if not line.startswith(("error:", "warning:"))]
    assert len(errors) == 1 and not others, result.stderr
    assert expected in errors[0], errors[0]
    assert "Traceback" not in result.output
    assert tree_hash(world) == before, "the run or its data was modified"
    assert not list(tmp_path.rglob("PWNED")), "a pickled payload ran"


def test_unsafe_trainer_state_never_runs_its_payload(world: Path, tmp_path: Path) -> None:
    from minillm.checkpoint.store import load_trainer_state
    from minillm.errors import CheckpointError

    ck = Path(corrupt_copy(world, tmp_path, pickle_bomb))
    with pytest.raises(CheckpointError, match="trainer_state.pt"):
        load_trainer_state(ck)
    assert not (ck / "PWNED").exists()


def test_at_least_25_cases() -> None:
    assert len(CASES) >= 25
