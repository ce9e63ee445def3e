"""`--quantize nf4` / `int8` on the inference commands quantize each linear layer as the load
reads it (minillm.checkpoint.quantized_load): the codes and logits are those of loading the
whole model and quantizing it after, and the load's peak is the quantized model plus a layer, not
the model in its load dtype."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.families import fused_rows
from minillm.model.quantize import int8_kernel_problem, quantize_int8
from tests.helpers import llama_folder, make_run

bnb = pytest.importorskip("bitsandbytes")
runner = CliRunner()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A minillm run (tied head) and a Hugging Face folder exported from another (untied)."""
    root = tmp_path_factory.mktemp("qload")
    run_dir, _, _ = make_run(root / "run", model={"d_model": 128, "ffn_hidden": 256})
    other, _, _ = make_run(root / "other", model={"tie_embeddings": False}, seed=1)
    result = runner.invoke(app, ["export", "--ckpt", str(other), "--out", str(root / "hf")])
    assert result.exit_code == 0, result.output
    # DeepSeek-V3's kind: latent attention, a dense first layer, then experts and a shared one.
    mla = dict(attention="mla", n_kv_head=None, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
               qk_rope_head_dim=8, v_head_dim=8, n_experts=4, n_experts_per_token=2,
               moe_shared_ffn_hidden=32, moe_dense_layers=[0])  # fmt: skip
    moe, _, _ = make_run(root / "moe", model=mla, seed=2)
    return {"run": run_dir, "hf": root / "hf", "mla-moe": moe}


def quantized_after(source: Path, quantize: str, **kw: object) -> torch.nn.Module:
    """What `--quantize` did before: the model loaded whole, then quantized in place."""
    from minillm.model.nf4 import quantize_nf4

    loaded = load_checkpoint(source, **kw)  # type: ignore[arg-type]
    if quantize == "nf4":
        return quantize_nf4(loaded.model, fused_rows(loaded.config.model))
    assert quantize_int8(loaded.model) is None
    return loaded.model


@pytest.mark.parametrize("kind", ["run", "hf", "mla-moe"])
@pytest.mark.parametrize("quantize", ["nf4", "int8"])
@torch.no_grad()
def test_quantizing_as_it_loads_gives_the_codes_of_quantizing_after(
    sources: dict[str, Path], kind: str, quantize: str
) -> None:
    """The same layers quantized from the same tensors: the packed codes and the logits equal
    bit for bit (nf4 in the weights' bfloat16 as --dtype bfloat16 asks, int8 from float32)."""
    if quantize == "int8" and int8_kernel_problem() is not None:
        pytest.skip(int8_kernel_problem())
    dtype = "bfloat16" if quantize == "nf4" else "float32"
    new = load_checkpoint(sources[kind], dtype=dtype, quantize=quantize).model
    old = quantized_after(sources[kind], quantize, dtype=dtype)
    assert new.quantized == old.quantized == quantize
    assert [type(m) for m in new.modules()] == [type(m) for m in old.modules()]
    if quantize == "nf4":
        codes = [(n, b) for n, b in new.named_buffers() if "packed" in n]
        if kind != "mla-moe":
            assert len(codes) == 7 * len(new.blocks)  # wqkv's q, k, v; gate, up; wo; w_down
        assert all(torch.equal(b, old.get_buffer(n)) for n, b in codes)
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(new(tokens)[0], old(tokens)[0])


@pytest.mark.parametrize("kind", ["run", "hf"])
@pytest.mark.parametrize("quantize", ["nf4", "int8"])
@torch.no_grad()
def test_a_quantized_load_read_at_another_context_keeps_its_layers(
    sources: dict[str, Path], kind: str, quantize: str
) -> None:
    """`--set model.max_seq_len=...` (at_context) on a model quantized as it loaded: the same
    logits as the old order (load, at_context, quantize); int8's copy of a tied head too."""
    from minillm.checkpoint.store import at_context

    if quantize == "int8" and int8_kernel_problem() is not None:
        pytest.skip(int8_kernel_problem())
    wider = ["model.max_seq_len=128"]
    new = at_context(load_checkpoint(sources[kind], quantize=quantize), wider)
    assert new.config.model.max_seq_len == 128 and new.model.quantized == quantize
    old = at_context(load_checkpoint(sources[kind]), wider)
    if quantize == "nf4":
        from minillm.model.nf4 import quantize_nf4

        quantize_nf4(old.model, fused_rows(old.config.model))
    else:
        quantize_int8(old.model)
    tokens = torch.randint(0, 300, (1, 100), generator=torch.Generator().manual_seed(1))
    assert torch.equal(new.model(tokens)[0], old.model(tokens)[0])


def test_each_layer_is_quantized_before_the_next_is_read(
    sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load interleaves: block 0's layers are NF4 before block 1's weights are read, each
    quantized from its weight on the load's device (on a GPU: there, as the model quantized
    after the load was; tests/test_quantized_load.py's cuda test runs it)."""
    from minillm.checkpoint import lazy
    from minillm.model import nf4

    events: list[tuple[str, str]] = []
    read, init = lazy.LazySafetensors.__getitem__, nf4.NF4Linear.__init__

    def logged_read(self: lazy.LazySafetensors, key: str) -> torch.Tensor:
        events.append(("read", key))
        return read(self, key)

    def logged_init(self: nf4.NF4Linear, weight: torch.Tensor, *args: object) -> None:
        events.append(("nf4", str(weight.device)))
        init(self, weight, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(lazy.LazySafetensors, "__getitem__", logged_read)
    monkeypatch.setattr(nf4.NF4Linear, "__init__", logged_init)
    load_checkpoint(sources["hf"], device="cpu", quantize="nf4")
    first_of_block1 = next(i for i, (e, k) in enumerate(events) if ".layers.1." in k)
    assert sum(e == "nf4" for e, _ in events[:first_of_block1]) == 4
    assert {k for e, k in events if e == "nf4"} == {"cpu"}


@pytest.mark.cuda
@torch.no_grad()
def test_on_cuda_each_layer_is_quantized_on_the_gpu(sources: dict[str, Path]) -> None:
    """Loaded onto the GPU, each layer is quantized there: the codes of the whole model loaded
    onto it and quantized after."""
    new = load_checkpoint(sources["hf"], device="cuda", dtype="bfloat16", quantize="nf4").model
    old = quantized_after(sources["hf"], "nf4", device="cuda", dtype="bfloat16")
    codes = [(n, b) for n, b in new.named_buffers() if "packed" in n]
    assert codes and all(b.is_cuda and torch.equal(b, old.get_buffer(n)) for n, b in codes)


def test_a_model_without_linear_layers_to_quantize_is_one_error(
    sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing made NF4 is said, naming --quantize, not run in float as if it were."""
    from minillm.checkpoint import store
    from minillm.errors import ConfigError
    from minillm.model import nf4

    monkeypatch.setattr(store, "as_loaded", lambda *a: (None, None))
    monkeypatch.setattr(nf4, "linear_slots", lambda model: [])
    with pytest.raises(ConfigError, match="--quantize: nf4: the model has no linear layers"):
        load_checkpoint(sources["run"], quantize="nf4")


PEAK = """
import resource, sys
import torch
from minillm.checkpoint.store import load_checkpoint
from minillm.model.nf4 import NF4Linear
NF4Linear(torch.randn(128, 64)).dequantized()  # bitsandbytes' own start-up, not the model's
with open("/proc/self/statm") as f:  # resident now: the imports' own peak may lie above
    before = int(f.read().split()[1]) * resource.getpagesize()
model = load_checkpoint(sys.argv[1], dtype="auto", quantize="nf4").model
with open("/proc/self/status") as f:  # this process's peak (ru_maxrss keeps the forked parent's)
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(peak - before, sum(p.numel() * p.element_size() for p in model.parameters()))
"""


@pytest.mark.slow
def test_a_quantize_nf4_load_peaks_well_below_the_float_model(tmp_path: Path) -> None:
    """A bfloat16 folder of 8 layers (222 MB of weights, 189 MB of them the blocks' linear
    layers) loads with --quantize nf4 with a peak under 0.6x its weights' bytes + 12 MB above
    the process before: each layer is NF4 as it is read. Measured: 118 MB (0.53x); loaded
    whole in bfloat16 and quantized after, as before: 291 MB (1.31x). glibc's mmap threshold is
    fixed, as tests/test_qlora.py's peak test says why."""
    folder = tmp_path / "hf"
    hf = llama_folder(
        folder, torch.bfloat16, "60MB", vocab_size=8192, hidden_size=1024,
        intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=256,
    )  # fmt: skip
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    root = Path(__file__).resolve().parent.parent
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "MALLOC_MMAP_THRESHOLD_": "65536"}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", PEAK, str(folder)], capture_output=True, text=True, env=env,
        check=True,
    ).stdout.split()  # fmt: skip
    grew, kept_float = (int(x) for x in out)
    assert kept_float < 0.3 * weights  # the embedding, the head and the norms
    assert grew < 0.6 * weights + 12e6, (grew, weights)
