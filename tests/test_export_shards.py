"""`export --max-shard-size`: the weights in transformers' shards and index, written tensor by
tensor in the model's dtype (issue 60 item 6), loaded back by transformers and by `--ckpt`."""

from __future__ import annotations

import errno
import json
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from typer.testing import CliRunner

from minillm.checkpoint import hf_shards
from minillm.checkpoint.hf_export import export_checkpoint
from minillm.checkpoint.hf_shards import parse_size
from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.errors import UserError
from minillm.families import family_of
from tests.helpers import assert_same_function, error_line, make_run

runner = CliRunner()
SHARD = 40_000  # bytes: the tiny model's ~250 KB of float32 weights in 7 or more shards


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir, _, _ = make_run(tmp_path_factory.mktemp("shards"), model=dict(tie_embeddings=False))
    return run_dir


def shard_tensors(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{file: {name: tensor}} of every weights file in an exported folder."""
    found = {}
    for path in sorted(out.glob("model*.safetensors")):
        with safe_open(path, "pt") as f:
            found[path.name] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return found


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1.5kb", 1500),
        (" 40 KB ", 40_000),
        ("64KiB", 65536),
        ("123", 123),
        (123, 123),
    ],
)
def test_sizes_read_as_transformers_reads_them(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["5XB", "", "GB", "-1GB", "1e3", "0", "0.0001B", "5 G B"])
def test_a_bad_size_is_one_line_naming_the_option(text: str) -> None:
    with pytest.raises(UserError, match=r"^--max-shard-size: "):
        parse_size(text)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-shard-size", "5XB"], "--max-shard-size: '5XB' is not a size"),
        (["--max-shard-size", "0"], "--max-shard-size: '0' is not above 0 bytes"),
        (
            ["--max-shard-size", "1GB", "--format", "gguf"],
            "--max-shard-size: only with --format hf",
        ),
    ],
)
def test_cli_refuses_a_bad_max_shard_size_in_one_line(
    run: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    out = tmp_path / ("m.gguf" if "gguf" in args else "hf")
    result = runner.invoke(app, ["export", "--ckpt", str(run), "--out", str(out), *args])
    assert error_line(result).startswith(f"error: {message}")
    assert not out.exists()


@pytest.fixture(scope="module")
def sharded(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sharded") / "hf"
    args = ["export", "--ckpt", str(run), "--out", str(out), "--max-shard-size", f"{SHARD}B"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def test_shards_and_index_are_transformers_layout(run: Path, sharded: Path) -> None:
    files = shard_tensors(sharded)
    n = len(files)
    assert n >= 5 and list(files) == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    assert not (sharded / "model.safetensors").exists()
    assert not [p for p in sharded.iterdir() if p.name.startswith(".")]  # no provisional names
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {k: name for name, ts in files.items() for k in ts}
    every = [t for ts in files.values() for t in ts.values()]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in every)
    for ts in files.values():  # full shards, each under the limit (or one tensor alone)
        sizes = [t.numel() * t.element_size() for t in ts.values()]
        assert sum(sizes) <= SHARD or len(sizes) == 1
    assert json.loads((sharded / "config.json").read_text())["torch_dtype"] == "float32"


def test_transformers_loads_the_shards_with_our_logits(run: Path, sharded: Path) -> None:
    loaded = load_checkpoint(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32).eval()
    idx = torch.randint(0, loaded.config.model.vocab_size, (2, 40))
    with torch.no_grad():
        assert_same_function(hf(idx).logits, loaded.model(idx)[0])


def test_minillm_reads_the_shards_back_exactly(run: Path, sharded: Path) -> None:
    own = load_checkpoint(run).model.state_dict()
    back = load_checkpoint(sharded).model.state_dict()
    assert set(back) == set(own) and all(torch.equal(back[k], own[k]) for k in own)


def test_a_model_that_fits_one_shard_is_one_file(run: Path, tmp_path: Path) -> None:
    out = export_checkpoint(load_checkpoint(run), tmp_path / "hf", max_shard_size="10MB")
    assert list(shard_tensors(out)) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()


def test_a_bf16_model_is_exported_in_bf16(run: Path, tmp_path: Path) -> None:
    loaded = load_checkpoint(run, dtype=torch.bfloat16)
    out = export_checkpoint(loaded, tmp_path / "hf", max_shard_size=f"{SHARD // 2}B")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    files = shard_tensors(out)
    assert len(files) > 1 and all(
        t.dtype == torch.bfloat16 for ts in files.values() for t in ts.values()
    )
    back = load_checkpoint(out)  # --dtype auto: the folder's bf16, the same weights bit for bit
    own = loaded.model.state_dict()
    assert all(torch.equal(v, own[k]) for k, v in back.model.state_dict().items())
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
    assert hf.dtype == torch.bfloat16
    ours32 = load_checkpoint(out, dtype=torch.float32).model  # bf16 values, exact in float32
    idx = torch.randint(0, loaded.config.model.vocab_size, (2, 30))
    with torch.no_grad():
        assert_same_function(hf.float()(idx).logits, ours32(idx)[0])


def test_at_most_one_shard_of_new_tensors_is_alive(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tensor the family's to_hf yields is made new here (as Gemma's norms or a dtype
    conversion would be) and its storage followed by a weak reference (a storage lives while
    any view of it does): whatever keeps the whole state dict (a dict of all of them, as the
    writer before issue 60 built) keeps them all alive at the end."""
    loaded = load_checkpoint(run)
    family = type(family_of(loaded.config.model))
    to_hf = family.to_hf
    alive: list[weakref.ref[torch.UntypedStorage]] = []
    peak = {"bytes": 0, "largest": 0}

    def fresh(self: Any, cfg: Any, sd: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in to_hf(self, cfg, sd):
            new = t.clone()
            alive.append(weakref.ref(new.untyped_storage()))
            live = sum(s.nbytes() for r in alive if (s := r()) is not None)
            peak["bytes"] = max(peak["bytes"], live)
            peak["largest"] = max(peak["largest"], new.untyped_storage().nbytes())
            yield name, new

    monkeypatch.setattr(family, "to_hf", fresh)
    export_checkpoint(loaded, tmp_path / "hf", max_shard_size=f"{SHARD}B")
    total = sum(p.numel() * 4 for p in loaded.model.parameters())
    assert total > 3 * (SHARD + peak["largest"])  # the bound below means something
    assert peak["bytes"] <= SHARD + peak["largest"], (peak, total)
    assert all(r() is None for r in alive)  # and nothing kept once written


def test_a_full_disk_at_the_second_shard_leaves_out_as_it_was(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = export_checkpoint(load_checkpoint(run), tmp_path / "hf")  # an earlier export
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = hf_shards.save_safetensors, []

    def full_at_second(tensors: dict, path: Path, metadata: dict) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(tensors, path, metadata)

    monkeypatch.setattr(hf_shards, "save_safetensors", full_at_second)
    args = ["export", "--ckpt", str(run), "--out", str(out), "--force"]
    line = error_line(runner.invoke(app, [*args, "--max-shard-size", f"{SHARD}B"]))
    assert line.startswith(f"error: {tmp_path}: no space left on the device writing the hf export")
    assert "nothing at --out was changed" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no staging folder left
