"""What a (Q)LoRA run holds and reads. Its base identity (the sha256 its checkpoints record) is
computed as the base is read,
once: a QLoRA run's prepare reads each tensor of a Hugging Face folder once (it read the folder
three or four times more to hash it), and the digest is the one weights_sha256 gives the whole
loaded state_dict, so checkpoints written before resume against it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from minillm.checkpoint.lazy import LazySafetensors, by_group
from minillm.checkpoint.weights import SortedDigest, weights_sha256
from minillm.cli import app
from tests.helpers import SHAKESPEARE, llama_folder

runner = CliRunner()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 Llama folder of 12 layers in two shards: a folder yields blocks 0, 1, 2, ..., 11,
    the sorted names go 0, 1, 10, 11, 2, ...; untied head."""
    root = tmp_path_factory.mktemp("digest")
    llama_folder(
        root / "hf", torch.bfloat16, "300KB", vocab_size=1024, hidden_size=64,
        intermediate_size=128, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128,
    )  # fmt: skip
    (root / "corpus.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000])
    return root / "hf"


def lora_config(root: Path, folder: Path, quantize: str, precision: str = "fp32") -> Path:
    raw = {
        "data": {"source": str(folder.parent / "corpus.txt"), "out_dir": str(root / "tok")},
        "train": {"init_from": str(folder), "out_dir": str(root / "run"), "batch_size": 2,
                  "seq_len": 16, "max_steps": 1, "device": "cpu", "precision": precision,
                  "lora": {"rank": 4, "alpha": 8, "quantize": quantize}},
    }  # fmt: skip
    path = root / "lora.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert runner.invoke(app, ["tokenize", str(path)]).exit_code == 0
    return path


@pytest.mark.parametrize(
    "quantize, precision, threshold",
    [("nf4", "fp32", 1 << 20), ("none", "fp32", None), ("none", "bf16", 4 << 20)],
)
def test_a_lora_prepare_reads_each_base_tensor_once_and_records_its_sha256(
    folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    quantize: str,
    precision: str,
    threshold: int | None,
) -> None:
    """prepare_run of a (Q)LoRA run on a folder reads each stored tensor once (the load, which
    hashes what it reads), and records the sha256 weights_sha256 gives the float32 load. It
    fixes glibc's mmap threshold: 1 MB under QLoRA, 4 MB under bf16 LoRA (whose peak varied
    3.34-3.58 GB at 1.1B with glibc's rising one, 3.31 at 4 MB: LORA_MMAP_THRESHOLD); an fp32
    LoRA run keeps glibc's own."""
    if quantize == "nf4":
        pytest.importorskip("bitsandbytes")
    from minillm.checkpoint.hf_import import hf_model_config, load_hf_model
    from minillm.checkpoint.init_from import load_run_config
    from minillm.train.run import prepare_run

    path = lora_config(tmp_path, folder, quantize, precision)
    reads: dict[str, int] = {}
    get = LazySafetensors.__getitem__

    def counted(self: LazySafetensors, key: str) -> torch.Tensor:
        reads[key] = reads.get(key, 0) + 1
        return get(self, key)

    monkeypatch.setattr(LazySafetensors, "__getitem__", counted)
    thresholds: list[int] = []
    monkeypatch.setattr("minillm.train.run.map_large_blocks", thresholds.append)
    run = prepare_run(load_run_config(path), resume=False, verbose=False)
    try:
        assert thresholds == ([] if threshold is None else [threshold])
        assert reads and set(reads.values()) == {1}, reads
        assert len(reads) == len(LazySafetensors(sorted(folder.glob("*.safetensors"))))
        monkeypatch.setattr(LazySafetensors, "__getitem__", get)
        full = load_hf_model(folder, hf_model_config(folder)).state_dict()
        assert run.lora_base["sha256"] == weights_sha256(full)
    finally:
        run.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_digest_of_a_load_is_weights_sha256_of_its_state_dict(
    folder: Path, dtype: torch.dtype
) -> None:
    """base_digest fed by init_weights gives what weights_sha256 gives the loaded state_dict, in
    bf16 too (the digest of the weights rounded to it), a block held at most; with no room to
    hold what comes out of order (the folder's own order) it gives up, and says so (None)."""
    from minillm.checkpoint.hf_import import hf_model_config
    from minillm.checkpoint.init_from import base_digest, init_weights

    cfg = hf_model_config(folder)
    digest = base_digest(cfg, dtype)
    model, _ = init_weights(str(folder), cfg, dtype, digest=digest)
    half = dtype if dtype != torch.float32 else None
    assert digest.hexdigest() == weights_sha256(model.state_dict(), half)
    state = model.state_dict()
    tight = SortedDigest(state, half, budget=0)
    for name, t in state.items():  # blocks 0, 1, 2, ...: 2 comes before 10 is hashed
        tight.add(name, t)
    assert tight.hexdigest() is None
    roomy = SortedDigest(state, half, budget=10**9)
    for name, t in reversed(state.items()):
        roomy.add(name, t)
    assert roomy.hexdigest() == digest.hexdigest()


def test_by_group_reads_blocks_in_sorted_order_once_and_falls_back(folder: Path) -> None:
    """by_group yields an adapter's pairs a block at a time in the sorted order of the names,
    each tensor read once; an adapter that reads a tensor before the pair it is for comes in
    its own order instead, every pair once."""
    src = LazySafetensors(sorted(folder.glob("*.safetensors")))
    names = sorted(src)

    def plain(s):  # noqa: ANN001, ANN202
        for name in reversed(names):
            yield name, s[name]

    got = [name for name, _ in by_group(plain, src)]
    assert got == names

    def early(s):  # noqa: ANN001, ANN202
        ahead = s[names[0]]  # read while computing another pair
        for name in reversed(names[1:]):
            yield name, s[name]
        yield names[0], ahead

    pairs = list(by_group(early, src))
    assert sorted(n for n, _ in pairs) == names
    assert not any(t.is_meta for _, t in pairs)
    for name, t in pairs:
        assert torch.equal(t, src[name]), name


FINITE_PEAK = """
import sys
import torch
from minillm.train.state import weights_finite
model = torch.nn.Linear(4096, 4096, bias=False)  # 64 MB of float32
assert weights_finite(torch.nn.Linear(8, 8), torch.device("cpu"))  # torch's own start-up
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM from here
def status(key):
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024
before = status("VmRSS")
assert weights_finite(model, torch.device("cpu"))
model.weight.data[7, 7] = float("nan")
assert not weights_finite(model, torch.device("cpu"))
print(status("VmHWM") - before, model.weight.nbytes)
"""


def test_the_finite_check_before_a_save_holds_no_copy_of_a_weight() -> None:
    """weights_finite (before each checkpoint) checks a weight in slices: its peak is under half
    the weight, where isfinite on the whole made a float copy and bool masks (2-3x the
    weight: the ~500 MB a TinyLlama QLoRA save added, for its float32 embedding and head)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", FINITE_PEAK], capture_output=True, text=True,
                         env=env, check=True).stdout.split()  # fmt: skip
    grew, weight = int(out[0]), int(out[1])
    assert grew < weight // 2, (grew, weight)  # measured 16-27 MB; 151-206 MB before
