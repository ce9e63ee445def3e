"""A full disk at every write (issue 53): one `error:` line naming the folder, the space needed
and what is free, exit 2, nothing existing changed and no temporary file left behind.

The full disk is stood in by the OSError(ENOSPC) a write raises, or by the RuntimeError that
torch.save raises on a real full disk."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from minillm.checkpoint import gguf_file, hf_shards, peft_folder
from minillm.checkpoint import store as ckpt
from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.data import tokenize_pass
from minillm.errors import UserError
from minillm.runtime.disk_space import full_disk_error, human_bytes, is_disk_full
from tests.helpers import error_line, make_run

runner = CliRunner()
NEEDS = r"no space left on the device writing .*\(needs about [\d.]+ [KMG]?B, [\d.]+ \w+ free\)"


def full_disk(*a: Any, **k: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_what_counts_as_a_full_disk() -> None:
    # torch.save's zip writer on a full disk (torch 2.x; seen in issue 53's traceback)
    torch_full = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    assert is_disk_full(RuntimeError(torch_full))
    assert is_disk_full(RuntimeError("PytorchStreamWriter failed writing file: file write failed"))
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(RuntimeError("shape mismatch"))


def test_the_line_names_folder_needed_and_free(tmp_path: Path) -> None:
    line = str(full_disk_error(tmp_path / "not" / "made", "x", 3_500_000, "then this"))
    assert line.startswith(f"{tmp_path / 'not' / 'made'}: no space left on the device writing x")
    assert "needs about 3.5 MB" in line and line.endswith("; then this")
    assert [human_bytes(n) for n in (999, 1000, 2_500_000_000)] == ["999 B", "1.0 KB", "2.5 GB"]


@pytest.mark.parametrize("error", ["oserror", "torch"])
def test_checkpoint_on_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: str
) -> None:
    run_dir, cfg, net = make_run(tmp_path)
    before = files_under(run_dir)

    def torch_full(*a: Any, **k: Any) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(ckpt.torch, "save", torch_full if error == "torch" else full_disk)
    with pytest.raises(UserError, match=NEEDS) as info:
        ckpt.save_checkpoint(run_dir, 20, net.state_dict(), {"step": 20}, {"step": 20})
    line = str(info.value)
    assert line.startswith(f"{run_dir / 'checkpoints'}: ") and "checkpoint step_000020" in line
    assert "LATEST still names the previous checkpoint" in line
    assert files_under(run_dir) == before  # no temporary folder, LATEST as it was


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir, _, _ = make_run(tmp_path_factory.mktemp("full-disk"))
    return run_dir


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_export_on_a_full_disk_is_one_line_exit_2(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    if fmt == "hf":
        monkeypatch.setattr(hf_shards, "save_safetensors", full_disk)
        out = tmp_path / "hf"
    else:
        import gguf

        monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
        out = tmp_path / "m.gguf"
    (tmp_path / "keep").write_text("mine")
    result = runner.invoke(app, ["export", "--ckpt", str(run), "--out", str(out), "--format", fmt])
    line = error_line(result)
    assert line.startswith(f"error: {tmp_path}: ") and out.name in line, line
    assert "nothing at --out was changed" in line
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]  # no temporary file or folder


def test_peft_export_on_a_full_disk(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    loaded = load_checkpoint(run)
    # Adapters stood in: the write fails before their format matters.
    loaded.adapters = {"layers.0.attn.wqkv.lora_A": torch.zeros(4, 64)}
    loaded.state["lora_base"] = {"path": "base"}
    monkeypatch.setattr(peft_folder, "to_peft_state_dict", lambda a, m: dict(a))
    monkeypatch.setattr(peft_folder, "save_safetensors", full_disk)
    with pytest.raises(UserError, match=NEEDS):
        peft_folder.export_peft(loaded, tmp_path / "adapters")
    assert list(tmp_path.iterdir()) == []


def test_gguf_needs_the_tensors_bytes(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    loaded = load_checkpoint(run)
    with pytest.raises(UserError) as info:
        gguf_file.export_gguf(loaded, tmp_path / "m.gguf")
    state = {k: v.float() for k, v in loaded.model.state_dict().items()}
    tensors = gguf_file.gguf_tensors(state, loaded.config.model, "f32")
    assert f"needs about {human_bytes(sum(t.nbytes for _, t, _ in tensors))}," in str(info.value)


def test_tokenizer_and_shards_on_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from tests.test_data import EXCERPT, make_cfg, write_text

    src = str(write_text(tmp_path / "s.txt", EXCERPT))
    cfg = make_cfg(tmp_path, source=src)
    # The tokenizer it trains is written first, into the staging folder.
    monkeypatch.setattr(tokenize_pass, "atomic_write_text", full_disk)
    with pytest.raises(UserError, match=r"tokens: no space left on the device .*\(it resumes\)"):
        tokenize_pass.write_shards(cfg)
    assert not (tmp_path / "tokens").exists() and not cfg.data.tokenizer_path.exists()
