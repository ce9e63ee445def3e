"""QLoRA (issue 60, item 3): `train.lora.quantize: nf4` holds the frozen base in bitsandbytes'
4-bit NF4 with the adapters on top, `--quantize nf4` on the inference commands. The layer is
bitsandbytes' Linear4bit's function, a fused projection is quantized per Hugging Face module,
the step-0 loss is peft + bitsandbytes QLoRA's on the same folder, a merged export is the
dequantized base plus the adapters, and the peft export loads in peft onto the 4-bit base."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from typer.testing import CliRunner

from minillm.cli import app
from minillm.model.nf4 import NF4Linear
from tests.helpers import SHAKESPEARE, error_line, llama_folder, make_run, make_trainer

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
runner = CliRunner()
TRAIN = dict(batch_size=2, seq_len=16, max_steps=2, warmup_steps=0, eval_every=2, eval_steps=1,
             ckpt_every=2, log_every=1, device="cpu", precision="fp32", lr=1e-2)  # fmt: skip


def rel_close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """|a - b| <= rel * max|b|, in float64."""
    a, b = a.double(), b.double()
    return bool((a - b).abs().max() <= rel * b.abs().max())


def bnb_config() -> transformers.BitsAndBytesConfig:
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )  # fmt: skip


def bnb_model(folder: Path) -> transformers.PreTrainedModel:
    """transformers' 4-bit load of `folder` (peft's QLoRA base), fp32 compute."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=bnb_config(), dtype=torch.float32, device_map="cpu"
    ).eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny published-style folder (minillm's export of a random run) and a corpus."""
    root = tmp_path_factory.mktemp("qlora")
    run_dir, _, _ = make_run(root / "base", model={"d_model": 128, "ffn_hidden": 256})
    result = runner.invoke(app, ["export", "--ckpt", str(run_dir), "--out", str(root / "hf")])
    assert result.exit_code == 0, result.output
    (root / "corpus.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000])
    return root / "hf"


def qlora_config(root: Path, folder: Path, **lora) -> Path:
    raw = {
        "data": {"source": str(folder.parent / "corpus.txt"), "out_dir": str(root / "tok")},
        "train": {"init_from": str(folder), "out_dir": str(root / "run"), **TRAIN,
                  "lora": {"rank": 4, "alpha": 8, "quantize": "nf4", **lora}},
    }  # fmt: skip
    path = root / "qlora.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_layer_is_bitsandbytes_linear4bit() -> None:
    """NF4Linear's output is Linear4bit's (nf4, double quantization) on the same weight, and
    its codes are not the float weight (the error is NF4's)."""
    torch.manual_seed(0)
    w, x = torch.randn(96, 128) * 0.05, torch.randn(5, 128)
    ours = NF4Linear(w)
    ref = bnb.nn.Linear4bit(128, 96, bias=False, compute_dtype=torch.float32, quant_type="nf4",
                            compress_statistics=True)  # fmt: skip
    ref.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="nf4",
                                   compress_statistics=True)._quantize("cpu")  # fmt: skip
    assert rel_close(ours(x), ref(x), 1e-5)
    err = (ours.dequantized() - w).abs().max() / w.abs().max()
    assert 1e-3 < err < 0.2
    big = torch.randn(512, 512)
    assert NF4Linear(big).nbytes() < big.numel() * 0.55  # 4.4 bits a weight, not bf16's 16


def test_a_fused_projection_is_quantized_per_module() -> None:
    """wqkv's rows q, k, v quantized each on its own, as bitsandbytes quantizes peft's three
    modules; quantized whole, the double quantization gives other codes."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(n, 64) * s for n, s in ((256, 0.02), (128, 0.3), (128, 0.05)))
    fused = NF4Linear(torch.cat([q, k, v]), parts=(256, 128, 128)).dequantized()
    alone = torch.cat([NF4Linear(t).dequantized() for t in (q, k, v)])
    assert torch.equal(fused, alone)
    assert not torch.equal(NF4Linear(torch.cat([q, k, v])).dequantized(), alone)


def test_a_quantized_model_counts_the_same_flops() -> None:
    """MFU's FLOPs per token do not drop when the base's weights become NF4 buffers."""
    from minillm.model import Transformer
    from minillm.model.nf4 import quantize_nf4
    from tests.helpers import tiny_model_config

    model = Transformer(tiny_model_config(vocab_size=320)).eval()
    before = model.flops_per_token(32)
    assert quantize_nf4(model).flops_per_token(32) == before


def test_a_step_is_backward_through_4_bits_and_trains_the_adapters_only() -> None:
    """The gradient of x through NF4Linear is the dequantized weight's, in float64 terms."""
    torch.manual_seed(2)
    w = torch.randn(48, 64) * 0.1
    layer = NF4Linear(w)
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x2, layer.dequantized()).square().sum().backward()
    assert rel_close(x.grad, x2.grad, 1e-5)
    assert not any(p.requires_grad for p in layer.parameters())


def test_the_native_dequantizer_is_called_only_on_checked_bitsandbytes_releases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scratch path calls bitsandbytes' C kernel through ctypes with the arguments of the
    releases it was checked on; another release (whose signature may differ) gets None, so the
    step takes dequantize_4bit's own path instead of a call with the wrong arguments."""
    import bitsandbytes

    from minillm.model import nf4

    monkeypatch.setattr(bitsandbytes, "__version__", "0.99.0")
    nf4._cpu_kernel.cache_clear()
    try:
        assert nf4._cpu_kernel(torch.float32) is None
    finally:
        nf4._cpu_kernel.cache_clear()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("upcast", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_through_the_scratch_buffer_is_bitwise_the_fresh_weights(
    dtype: torch.dtype, upcast: bool, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward and backward dequantize into a reused scratch buffer, fused parts into their rows
    and in the input's dtype: the output and the input's gradient are the products with a fresh
    dequantized() weight bit for bit (the code before the buffer), for layers of two shapes in
    turn (the buffer grows), with bf16's fp32 path forced on and off, by bitsandbytes' native CPU
    kernel or its fallback; dequantized() stays a tensor of its own, which the next layer does
    not overwrite."""
    from minillm.model import bf16_cpu, nf4

    monkeypatch.setattr(bf16_cpu, "bf16_slow", lambda: upcast)
    if not native:
        monkeypatch.setattr(nf4, "_cpu_kernel", lambda dtype: None)
    elif nf4._cpu_kernel(dtype) is None:
        pytest.skip("this bitsandbytes has no native CPU kernel")
    torch.manual_seed(3)
    small = NF4Linear(torch.randn(48, 64, dtype=dtype) * 0.1, parts=(32, 8, 8))
    large = NF4Linear(torch.randn(96, 128) * 0.1)  # fp32 weight: a bf16 input casts it
    for layer in (small, large, small):
        kept = layer.dequantized()
        x = torch.randn(2, 5, layer.in_features, dtype=dtype, requires_grad=True)
        g = torch.randn(2, 5, layer.out_features, dtype=dtype)
        y = layer(x)
        y.backward(g)
        w = layer.dequantized(dtype)
        if bf16_cpu.upcast_dtype(x) is None:
            want_y, want_gx = torch.nn.functional.linear(x.detach(), w), g @ w
        else:
            want_y = bf16_cpu.fp32_product(x.detach(), layer.dequantized(), None, dtype)
            want_gx = bf16_cpu.fp32_input_grad(g, layer.dequantized(), dtype)
        assert torch.equal(y.detach(), want_y) and torch.equal(x.grad, want_gx)
        assert torch.equal(layer.scratch_weight(dtype), w)
        other = large if layer is small else small
        other.scratch_weight(dtype)  # the next layer's product: kept is its own tensor
        assert torch.equal(kept, layer.dequantized())
    s1, s2 = small.scratch_weight(), large.scratch_weight()
    if small.dtype == large.dtype:
        assert s1.untyped_storage().data_ptr() == s2.untyped_storage().data_ptr()


def test_step_zero_loss_equals_peft_on_bitsandbytes(folder: Path, tmp_path: Path) -> None:
    """The QLoRA run's step-0 loss is peft + bitsandbytes QLoRA's on the same folder and
    tokens (B = 0: the 4-bit base's loss), and differs from the float base's by far more."""
    from minillm.checkpoint.init_from import load_run_config

    path = qlora_config(tmp_path, folder)
    assert runner.invoke(app, ["tokenize", str(path)]).exit_code == 0
    trainer = make_trainer(load_run_config(path, []), verbose=False)
    try:
        micro = trainer.batches(0)[0]
        with torch.no_grad():
            _, ours = trainer.model(micro.tokens, micro.targets)
    finally:
        trainer.close()
    hf = bnb_model(folder)
    assert isinstance(hf.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))  # fmt: skip
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    def loss(m: torch.nn.Module) -> torch.Tensor:  # targets are already the next tokens
        logits = m(micro.tokens).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), micro.targets.flatten())

    with torch.no_grad():
        theirs, base = loss(model), loss(plain)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)
    assert abs(float(base) - float(theirs)) > 100 * 1e-5 * float(theirs)


def test_training_exports_merged_and_peft_adapters_that_peft_loads(
    folder: Path, tmp_path: Path
) -> None:
    """Two QLoRA steps through the CLI and one more resumed; `export` merges the adapters into
    the dequantized base
    (the function eval scores), and `--format peft`'s adapters on transformers' 4-bit base give
    that merged model's logits."""
    path = qlora_config(tmp_path, folder)
    for command in (["tokenize", str(path)], ["train", str(path)]):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    resumed = runner.invoke(app, ["train", str(path), "--set", "train.max_steps=3"])
    assert resumed.exit_code == 0, resumed.output  # the base quantized again, the adapters loaded
    assert (run / "checkpoints" / "step_000003").is_dir()
    for fmt in ("hf", "peft"):
        result = runner.invoke(app, ["export", "--ckpt", str(run), "--out", str(tmp_path / fmt),
                                     "--format", fmt])  # fmt: skip
        assert result.exit_code == 0, result.output
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    adapted = peft.PeftModel.from_pretrained(bnb_model(folder), tmp_path / "peft").eval()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = merged(ids).logits, adapted(ids).logits
    assert rel_close(got, want, 1e-4)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4


def test_quantize_nf4_on_the_inference_commands(folder: Path, tmp_path: Path) -> None:
    """`eval --quantize nf4` scores the 4-bit model: close to fp32's loss, not equal; `sample
    --quantize nf4` decodes (the decoder through NF4Linear's forward and add_to)."""
    data = tmp_path / "text.txt"
    data.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:600])
    losses = {}
    for kind in ("none", "nf4"):
        result = runner.invoke(app, ["eval", "--ckpt", str(folder), "--data", str(data),
                                     "--json", "--quantize", kind])  # fmt: skip
        assert result.exit_code == 0, result.output
        losses[kind] = json.loads(result.stdout)["loss"]
    assert losses["nf4"] != losses["none"]
    assert losses["nf4"] == pytest.approx(losses["none"], rel=0.05)
    result = runner.invoke(app, ["sample", "--ckpt", str(folder), "--prompt", "the",
                                 "--quantize", "nf4", "--max-new-tokens", "6"])  # fmt: skip
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "sets, what",
    [
        (["train.lora.rank=0"], "train.lora.quantize: nf4 quantizes the frozen base"),
        (["train.lora.quantize=nf8"], "train.lora.quantize"),
        (["train.parallel=fsdp"], "train.parallel: fsdp cannot shard"),
    ],
)
def test_bad_quantize_settings_are_one_error_line(
    folder: Path, tmp_path: Path, sets: list[str], what: str
) -> None:
    path = qlora_config(tmp_path, folder)
    args = ["train", str(path)]
    for s in sets:
        args += ["--set", s]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert what in error_line(result)


def test_a_bf16_step_moves_the_adapters_and_keeps_the_codes(folder: Path, tmp_path: Path) -> None:
    """Under bf16 autocast a QLoRA step is finite, trains only the adapters (fp32) and leaves
    the 4-bit codes as they were."""
    from minillm.checkpoint.init_from import load_run_config

    path = qlora_config(tmp_path, folder)
    assert runner.invoke(app, ["tokenize", str(path)]).exit_code == 0
    cfg = load_run_config(path, ["train.precision=bf16"])
    trainer = make_trainer(cfg, verbose=False)
    try:
        layers = [m for m in trainer.model.modules() if isinstance(m, NF4Linear)]
        assert len(layers) == 4 * cfg.model.n_layer
        codes = [m.packed0.clone() for m in layers]
        trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
                   if p.requires_grad}  # fmt: skip
        assert trained and all(v.dtype == torch.float32 for v in trained.values())
        out = trainer.train_step()
        assert out.finite
        after = dict(trainer.model.named_parameters())
        assert any(not torch.equal(after[n], v) for n, v in trained.items())
        assert all(torch.equal(m.packed0, c) for m, c in zip(layers, codes, strict=True))
    finally:
        trainer.close()


@pytest.mark.cuda
def test_on_cuda_the_layer_moves_and_is_linear4bits(folder: Path, tmp_path: Path) -> None:
    """Quantized on the CPU and moved (as the Trainer does), the layer computes bitsandbytes'
    CUDA Linear4bit; a QLoRA step on the GPU holds its base in 4 bits (peak memory printed for
    scripts/gpu_check.sh's log)."""
    from minillm.checkpoint.init_from import load_run_config

    torch.manual_seed(0)
    w, x = torch.randn(256, 128) * 0.05, torch.randn(5, 128, device="cuda")
    ours = NF4Linear(w).to("cuda")
    ref = bnb.nn.Linear4bit(128, 256, bias=False, compute_dtype=torch.float32, quant_type="nf4",
                            compress_statistics=True)  # fmt: skip
    ref.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="nf4",
                                   compress_statistics=True)  # fmt: skip
    ref = ref.to("cuda")
    assert rel_close(ours(x), ref(x), 1e-4)
    path = qlora_config(tmp_path, folder)
    assert runner.invoke(app, ["tokenize", str(path)]).exit_code == 0
    cfg = load_run_config(path, ["train.device=cuda", "train.precision=bf16"])
    torch.cuda.reset_peak_memory_stats()
    trainer = make_trainer(cfg, verbose=False)
    try:
        assert trainer.train_step().finite
        assert all(m.packed0.is_cuda for m in trainer.model.modules() if isinstance(m, NF4Linear))
        print(f"QLoRA step peak GPU memory: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    finally:
        trainer.close()


QLORA_PEAK = """
import sys
import torch
from minillm.checkpoint.hf_import import hf_model_config
from minillm.checkpoint.init_from import base_digest, init_weights, lora_base
from minillm.families import fused_rows
from minillm.model.nf4 import NF4Linear, nf4_as_loaded, nf4_problem
cfg = hf_model_config(sys.argv[1])
assert nf4_problem() is None
NF4Linear(torch.randn(128, 64)).dequantized()  # bitsandbytes' own start-up, not the model's
# The RSS now, and the peak from now on (VmHWM, reset: the imports' peak may be above the load's).
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
def status(key):
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024
before = status("VmRSS")
# What prepare_run does for a QLoRA run: the load, which computes the base's identity.
digest = base_digest(cfg, torch.float32)
model, _ = init_weights(sys.argv[1], cfg, torch.float32, nf4_as_loaded(fused_rows(cfg)), digest)
sha = lora_base(sys.argv[1], None, torch.float32, cfg, digest.hexdigest())["sha256"]
peak = status("VmHWM")
nf4 = [m for m in model.modules() if isinstance(m, NF4Linear)]
assert len(nf4) == 4 * cfg.n_layer, len(nf4)
block = sum(4 * m.in_features * m.out_features for m in nf4) // cfg.n_layer
rest = sum(p.numel() * p.element_size() for p in model.parameters())
print(peak - before, sum(m.nbytes() for m in nf4), block, rest, sha)
"""


@pytest.mark.slow
def test_a_qlora_load_peaks_at_the_nf4_model_plus_a_layer(tmp_path: Path) -> None:
    """A float32 QLoRA base of ~100 MB (8 layers of 12.6 MB) loads, in a fresh process, with a
    peak of at most its NF4 layers, the parameters kept in float (embedding, head, norms), two
    layers in float32 and 12 MB of slack above the process before: each layer becomes NF4 as it
    is read and the base's sha256 is computed as it is read, one block held at most. Measured:
    42-46 MB (NF4 13 MB, the rest 4 MB); loading the whole base in float32 and quantizing it
    after, as before: 145 MB. The sha256 is the one the full load's state_dict gives.

    The process keeps glibc's own malloc settings (a fixed mmap threshold hid the layers freed
    into the heap and kept there, ~700 MB of a TinyLlama-sized load before the load gave them
    back: lazy.release_freed_memory), and the peak is VmHWM reset after the imports (their peak,
    which ru_maxrss keeps, may be above the load's)."""
    from minillm.checkpoint.hf_import import load_hf_model
    from minillm.checkpoint.weights import weights_sha256

    folder = tmp_path / "hf"
    llama_folder(
        folder, torch.float32, "40MB", vocab_size=1024, hidden_size=512, intermediate_size=1536,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=256,
    )  # fmt: skip
    root = Path(__file__).resolve().parent.parent
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", QLORA_PEAK, str(folder)],
        capture_output=True, text=True, env=env, check=True,
    ).stdout.split()  # fmt: skip
    grew, nf4_bytes, layer_bytes, rest_bytes = (int(x) for x in out[:4])
    assert layer_bytes * 8 > 100e6
    assert grew <= nf4_bytes + rest_bytes + 2 * layer_bytes + 12e6, (grew, out)
    from minillm.checkpoint.hf_import import hf_model_config

    full = load_hf_model(folder, hf_model_config(folder)).state_dict()
    assert out[4] == weights_sha256(full)


def test_streamed_sha256_is_weights_sha256_in_any_order_and_budget() -> None:
    """The base's identity read in passes is the digest of the whole state_dict, with the names
    yielded in a folder's order (blocks 0, 1, 2, ... 11: sorted 0, 1, 10, 11, 2, ...) and a
    budget from nothing kept to everything; a name the source lacks is a KeyError."""
    from minillm.checkpoint.weights import streamed_sha256, weights_sha256

    g = torch.Generator().manual_seed(0)
    state = {f"blocks.{i}.{n}": torch.randn(3, 4, generator=g) for i in range(12) for n in "ba"}
    state["tok_emb.weight"] = torch.randn(5, 4, generator=g)
    want = weights_sha256(state, torch.bfloat16)
    for budget in (0, 48, 10**6):
        got = streamed_sha256(list(state), lambda: iter(state.items()), torch.bfloat16, budget)
        assert got == want, budget
    with pytest.raises(KeyError):
        streamed_sha256([*state, "norm.weight"], lambda: iter(state.items()), None, 48)


def test_a_base_quantized_as_it_loads_is_the_one_quantized_after(folder: Path) -> None:
    """nf4_as_loaded gives the codes quantize_nf4 gives the whole loaded model, and add_lora on
    it draws the same adapters from the same seed (a seeded QLoRA run starts as before)."""
    from minillm.checkpoint.hf_import import hf_model_config
    from minillm.checkpoint.init_from import init_weights
    from minillm.config import LoRAConfig
    from minillm.families import fused_rows
    from minillm.model.lora import add_lora
    from minillm.model.nf4 import nf4_as_loaded, quantize_nf4

    cfg = hf_model_config(folder)
    lora = LoRAConfig(rank=4, alpha=8, quantize="nf4")
    models = []
    for hook in (True, False):
        model, _ = init_weights(str(folder), cfg, torch.float32,
                                nf4_as_loaded(fused_rows(cfg)) if hook else None)  # fmt: skip
        torch.manual_seed(3)
        add_lora(model, lora)
        models.append(quantize_nf4(model, fused_rows(cfg), "train.lora.quantize"))
    now, before = (dict(m.named_modules()) for m in models)
    assert sum(isinstance(m, NF4Linear) for m in now.values()) == 4 * cfg.n_layer
    for name, m in now.items():
        if isinstance(m, NF4Linear):
            assert torch.equal(m.dequantized(), before[name].dequantized()), name
    assert models[0].state_dict().keys() == models[1].state_dict().keys()
    for name, t in models[0].state_dict().items():
        assert torch.equal(t, models[1].state_dict()[name]), name
