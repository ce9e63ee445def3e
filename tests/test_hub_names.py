"""Published models by their Hub name (issue 60, item 4): `--ckpt org/name` and `train.init_from:
org/name` read the Hugging Face cache in the hub's own layout (`models--org--name/refs/main`,
`snapshots/<rev>/`) with HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing at it, through the CLI; a
local folder of that name wins; a name the cache lacks offline is one error line; only the
files minillm reads are fetched."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from minillm.checkpoint import hub
from minillm.cli import app
from minillm.config.hub_id import is_hub_id
from tests.helpers import ROOT, SHAKESPEARE, error_line, make_run

runner = CliRunner()
REV = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """`folder`'s files as the cached snapshot of `repo_id` at REV, as huggingface_hub lays it
    out (blobs named by content, the snapshot's files linking to them)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    snapshot, blobs = repo / "snapshots" / REV, repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(folder.iterdir())):
        shutil.copyfile(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    return snapshot


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An exported tiny model as `org/tiny` in a hub cache; (its folder, the cache)."""
    root = tmp_path_factory.mktemp("hub")
    run_dir, _, _ = make_run(root / "a")
    result = runner.invoke(app, ["export", "--ckpt", str(run_dir), "--out", str(root / "hf")])
    assert result.exit_code == 0, result.output
    hub_cache(root / "cache", "org/tiny", root / "hf")
    return root / "hf", root / "cache"


@pytest.fixture
def offline(published, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Offline, the cache at HF_HUB_CACHE, in an empty current folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(published[1]))
    monkeypatch.chdir(tmp_path)
    hub._snapshot.cache_clear()
    return tmp_path


def greedy(ckpt: str) -> str:
    result = runner.invoke(app, ["sample", "--ckpt", ckpt, "--prompt", "the", "--temperature",
                                 "0", "--max-new-tokens", "8", "--device", "cpu"])  # fmt: skip
    assert result.exit_code == 0, result.output
    return result.stdout


def test_hub_ids_are_org_slash_name_and_not_a_local_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    table = {
        "meta-llama/Llama-3.2-1B": True,
        "HuggingFaceTB/SmolLM2-135M-Instruct": True,
        "Qwen/Qwen3-0.6B": True,
        "runs/tiny": False,  # runs/ is a folder here: a local path
        "tiny": False,
        "a/b/c": False,
        "/abs/path": False,
        "org/../x": False,
        "org/na--me": False,
        "./x": False,
    }
    assert {k: is_hub_id(k) for k in table} == table


def test_only_the_files_minillm_reads_are_fetched() -> None:
    """The allow and ignore patterns, as huggingface_hub applies them, over a published
    repository's files (Mistral's: sharded weights beside a consolidated copy)."""
    from huggingface_hub.utils import filter_repo_objects

    files = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json",
             "consolidated.safetensors", "params.json", "tokenizer.json", "tokenizer.model",
             "tokenizer_config.json", "special_tokens_map.json", "README.md",
             "original/model.safetensors", "pytorch_model.bin", "onnx/model.onnx"]  # fmt: skip
    got = list(filter_repo_objects(files, allow_patterns=hub.ALLOW, ignore_patterns=hub.IGNORE))
    assert sorted(got) == sorted(["config.json", "generation_config.json",
                                  "model-00001-of-00002.safetensors",
                                  "model-00002-of-00002.safetensors",
                                  "model.safetensors.index.json", "tokenizer.json",
                                  "tokenizer.model", "tokenizer_config.json",
                                  "special_tokens_map.json"])  # fmt: skip


def test_sample_eval_and_info_read_a_hub_name_from_the_cache(published, offline: Path) -> None:
    folder, _ = published
    assert greedy("org/tiny") == greedy(str(folder))
    data = offline / "text.txt"
    data.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:400], encoding="utf-8")
    by_name = runner.invoke(app, ["eval", "--ckpt", "org/tiny", "--data", str(data), "--json"])
    by_path = runner.invoke(app, ["eval", "--ckpt", str(folder), "--data", str(data), "--json"])
    assert by_name.exit_code == 0, by_name.output
    assert json.loads(by_name.stdout) == json.loads(by_path.stdout)
    assert "org/tiny" in runner.invoke(app, ["info", "--ckpt", "org/tiny"]).stdout  # its title
    info = runner.invoke(app, ["info", "--ckpt", "org/tiny", "--json"])
    assert info.exit_code == 0, info.output
    assert (
        json.loads(info.stdout)["params"]
        == json.loads(runner.invoke(app, ["info", "--ckpt", str(folder), "--json"]).stdout)[
            "params"
        ]
    )


def test_a_local_folder_of_that_name_wins(published, offline: Path) -> None:
    """org/tiny in the current folder (another model) is read, not the cache's."""
    other, _, _ = make_run(offline / "b", seed=5)
    result = runner.invoke(app, ["export", "--ckpt", str(other), "--out", "org/tiny"])
    assert result.exit_code == 0, result.output
    assert greedy("org/tiny") == greedy(str(offline / "org" / "tiny"))
    assert greedy("org/tiny") != greedy(str(published[0]))


def test_a_name_the_cache_lacks_offline_is_one_error_line(published, offline: Path) -> None:
    result = runner.invoke(app, ["sample", "--ckpt", "org/absent", "--prompt", "x"])
    assert result.exit_code == 2
    line = error_line(result)
    assert "org/absent" in line and "HF_HUB_OFFLINE=1" in line and str(published[1]) in line
    assert "Traceback" not in result.output


def test_init_from_a_hub_name_fine_tunes_the_cached_model(
    published, offline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.init_from: org/tiny takes the snapshot's model, tokenizer and weights; the run's
    config keeps the name; a LoRA run's peft export names it as its base; with the cache moved,
    the run's base is found by its name in the new one."""
    shutil.copytree(published[1], offline / "cacheA", symlinks=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(offline / "cacheA"))
    (offline / "corpus.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000])
    raw = {
        "data": {"source": "corpus.txt", "out_dir": "tok"},
        "train": {"init_from": "org/tiny", "out_dir": "run", "batch_size": 2, "seq_len": 16,
                  "max_steps": 2, "warmup_steps": 1, "eval_every": 2, "eval_steps": 1,
                  "ckpt_every": 2, "log_every": 1, "device": "cpu", "precision": "fp32",
                  "lora": {"rank": 4}},
    }  # fmt: skip
    (offline / "sft.yaml").write_text(yaml.safe_dump(raw))
    for command in (["tokenize", "sft.yaml"], ["train", "sft.yaml"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
    assert "weights from org/tiny" in result.output
    assert (
        yaml.safe_load((offline / "run" / "config.yaml").read_text())["train"]["init_from"]
        == "org/tiny"
    )
    result = runner.invoke(app, ["export", "--ckpt", "run", "--out", "peft", "--format", "peft"])
    assert result.exit_code == 0, result.output
    adapter = json.loads((offline / "peft" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "org/tiny"
    (offline / "cacheA").rename(offline / "cacheB")
    monkeypatch.setenv("HF_HUB_CACHE", str(offline / "cacheB"))
    hub._snapshot.cache_clear()
    assert greedy("run") == greedy("run")  # loads: the base by name, from cacheB
    shutil.rmtree(offline / "cacheB")
    hub._snapshot.cache_clear()
    result = runner.invoke(app, ["sample", "--ckpt", "run", "--prompt", "x"])
    assert result.exit_code == 2 and "org/tiny" in error_line(result)


@pytest.mark.slow
def test_the_command_line_reads_the_environment(published, tmp_path: Path) -> None:
    """A fresh process: HF_HUB_OFFLINE and HF_HUB_CACHE as the user sets them."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": str(published[1]), "HOME": str(tmp_path)}  # fmt: skip
    args = [sys.executable, "-m", "minillm", "info", "--ckpt", "org/tiny", "--json"]
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["params"] > 0
    env["HF_HUB_CACHE"] = str(tmp_path / "empty")
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
