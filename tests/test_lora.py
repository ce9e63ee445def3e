"""LoRA adapters (`train.lora`, issue 33): step 0 is the base exactly, only the adapters train,
the fused adapter is peft's per-projection adapters, decoding and loading merge them into the
same function, checkpoints hold the adapters and the base's identity, resume is bitwise, and a
bad `train.lora` is one error line with nothing written."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from minillm.checkpoint.init_from import load_run_config
from minillm.checkpoint.layout import read_state
from minillm.checkpoint.peft_folder import to_peft_state_dict
from minillm.checkpoint.store import load_checkpoint, load_model_state, save_checkpoint
from minillm.cli import app
from minillm.config import LoRAConfig
from minillm.errors import UserError
from minillm.infer.engine import SamplingParams, generate
from minillm.model import Transformer, use_cpu_kernels
from minillm.model.lora import LoRALinear, add_lora, is_adapter, merge_lora
from tests.helpers import (
    QUICK_TRAIN,
    ROOT,
    SHAKESPEARE,
    assert_same_function,
    assert_same_weights,
    error_line,
    load_script,
    make_run,
    make_trainer,
    resumed_runs,
    run_trainer,
    spread_weights_,
    tiny_config,
    tiny_model_config,
    trained_run,
    write_shards,
)

runner = CliRunner()
LORA = dict(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenized corpus and a 4-step base run at base/run (the LoRA runs' init_from)."""
    return trained_run(tmp_path_factory.mktemp("lora-base"))


def lora_config(base: Path, out: Path, **train):  # noqa: ANN201
    train = {"out_dir": str(out), "init_from": str(base / "run"), "lora": LORA, **train}
    return tiny_config(base, train=train)


def random_model(seed: int = 0, **model) -> Transformer:  # noqa: ANN003
    """A tiny model whose logits are far from uniform (weights of a larger spread)."""
    torch.manual_seed(seed)
    return spread_weights_(Transformer(tiny_model_config(vocab_size=97, **model)).eval())


def with_random_adapters(net: Transformer, seed: int = 1, **lora) -> Transformer:  # noqa: ANN003
    """net with adapters whose B is not zero (a trained adapter's function)."""
    add_lora(net, LoRAConfig(**{**LORA, **lora}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return net.eval()


# ----------------------------------------------------------------------------- the module


def test_step_zero_is_the_base_exactly() -> None:
    net = random_model()
    idx = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        before = net(idx)[0]
        add_lora(net, LoRAConfig(rank=8, alpha=16.0, dropout=0.1))
        after = net.train()(idx)[0]  # dropout on the adapters' input changes nothing: B = 0
    assert torch.equal(before, after)
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter(n) for n in trainable)
    assert len(trainable) == 2 * 4 * net.cfg.n_layer


def test_the_fused_adapter_is_pefts_per_projection_adapters() -> None:
    """wqkv's one adapter = q, k, v adapters with A shared and B split by rows (gate/up too)."""
    net = with_random_adapters(random_model(n_kv_head=2))
    cfg = net.cfg
    adapters = {k: v for k, v in net.state_dict().items() if is_adapter(k)}
    peft = to_peft_state_dict(adapters, cfg)
    assert len(peft) == 2 * 7 * cfg.n_layer
    x = torch.randn(3, cfg.d_model)
    for i, block in enumerate(net.blocks):
        prefix = f"base_model.model.model.layers.{i}."
        for layer, part, modules in (
            (block.attn.wqkv, "self_attn", ("q_proj", "k_proj", "v_proj")),
            (block.attn.wo, "self_attn", ("o_proj",)),
            (block.ffn.w_gate_up, "mlp", ("gate_proj", "up_proj")),
            (block.ffn.w_down, "mlp", ("down_proj",)),
        ):
            assert isinstance(layer, LoRALinear)
            a = [peft[f"{prefix}{part}.{m}.lora_A.weight"] for m in modules]
            b = [peft[f"{prefix}{part}.{m}.lora_B.weight"] for m in modules]
            assert all(torch.equal(ai, layer.lora_A) for ai in a)
            assert torch.equal(torch.cat(b), layer.lora_B)
            # peft's forward of each projection, side by side with the fused layer's rows
            xx = (
                x
                if layer.base.in_features == cfg.d_model
                else torch.randn(3, layer.lora_A.shape[1])
            )
            bases = layer.base.weight.split([bi.shape[0] for bi in b])
            peft_out = torch.cat(
                [xx @ w.T + layer.scale * ((xx @ ai.T) @ bi.T) for w, ai, bi in zip(bases, a, b)],
                dim=-1,
            )
            with torch.no_grad():
                assert_same_function(layer(xx), peft_out)


def test_merged_weights_give_the_unmerged_function_and_decoding() -> None:
    """The merged model (what load_checkpoint returns) and the decoding core on the live LoRA
    model (whose Decoder reads each layer's merged `weight`) give the unmerged forward's logits
    and greedy tokens."""
    net = with_random_adapters(random_model())
    merged = merge_lora(copy.deepcopy(net)).eval()
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    idx = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        assert_same_function(merged(idx)[0], net(idx)[0])
    prompt = [5, 17, 42, 8]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        for _ in range(12):  # greedy by the unmerged full forward
            nxt = net(ids)[0][0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    expected = ids[0, len(prompt) :].tolist()
    for model in (net, merged):
        got = generate(model, [prompt], SamplingParams.greedy(12))
        assert list(got[0]) == expected


# ----------------------------------------------------------------------------- training


def test_only_the_adapters_train_and_the_base_stays_bitwise(base: Path, tmp_path: Path) -> None:
    base_weights = load_model_state(next((base / "run" / "checkpoints").glob("step_000004")))
    cfg = lora_config(base, tmp_path / "run", max_steps=3, ckpt_every=3, eval_every=3)
    trainer = make_trainer(cfg, verbose=False)
    try:
        x = torch.randint(0, 300, (2, 16))
        base_net = use_cpu_kernels(Transformer(cfg.model)).eval()  # as the trainer builds it
        base_net.load_state_dict(base_weights)
        trainer.model.eval()
        with torch.no_grad():
            assert torch.equal(trainer.model(x)[0], base_net(x)[0])  # step 0: the base exactly
        trainer.model.train()
        start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.fit()
    finally:
        trainer.close()
    end = trainer.model.state_dict()
    for name, value in end.items():
        if is_adapter(name):
            assert name.endswith("lora_A") or not torch.equal(value, start[name]), name
        else:  # every base tensor, embedding and norms included
            plain = name.replace(".base.weight", ".weight")
            assert torch.equal(value, base_weights[plain]), name
    assert any(not torch.equal(end[n], start[n]) for n in end if n.endswith("lora_A"))
    # the optimizer holds state for the adapters alone
    states = [p for opt in trainer.optimizer for p in opt.state]
    adapters = {id(p) for n, p in trainer.model.named_parameters() if is_adapter(n)}
    assert states and all(id(p) in adapters for p in states)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
    saved = load_model_state(ckpt)
    assert saved and all(is_adapter(k) for k in saved)
    record = json.loads((ckpt / "state.json").read_text())["lora_base"]
    assert record["path"] == str(base / "run") and record["source"].endswith("step_000004")
    # README's size rule: rank x (in + out) parameters per target layer (a fused one's A shared),
    # 4 bytes each in model.safetensors and AdamW's two moments (8) in trainer_state.pt.
    m, r = cfg.model, cfg.train.lora.rank
    q, kv, ffn = m.n_head * m.head_dim, m.n_kv_head * m.head_dim, m.ffn_hidden
    per_block = {"wqkv": m.d_model + q + 2 * kv, "wo": q + m.d_model,
                 "w_gate_up": m.d_model + 2 * ffn, "w_down": ffn + m.d_model}  # fmt: skip
    n = sum(t.numel() for t in saved.values())
    assert n == m.n_layer * r * sum(per_block[t] for t in cfg.train.lora.targets)
    assert 0 <= (ckpt / "model.safetensors").stat().st_size - 4 * n < 8_000  # + its header
    assert 0 <= (ckpt / "trainer_state.pt").stat().st_size - 8 * n < 64_000  # + RNG states


def test_muon_trains_the_adapters_only(base: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    cfg = lora_config(base, tmp_path / "run", max_steps=2, optimizer="muon", ckpt_every=2)
    trainer = make_trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    banner = capsys.readouterr().out
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in trainer.model.parameters()) - trainable
    assert f"LoRA rank 4: {trainable:,} trainable parameters, {frozen:,} frozen" in banner
    assert "muon (lr 0.02, weight decay 0) on" in banner and "the LoRA adapters" not in banner
    muon = trainer.optimizer.parts["muon"]
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert muon.state and all(is_adapter(names[id(p)]) for p in muon.state)
    assert not trainer.optimizer.parts["adamw"].state  # embedding, norms: frozen


def test_resume_of_a_lora_run_is_bitwise(base: Path, tmp_path: Path) -> None:
    cfg = lora_config(base, tmp_path / "straight", lora=dict(LORA, dropout=0.1))
    straight, _, resumed = resumed_runs(cfg, tmp_path, stop_at=3)  # saves at 3, between ckpts
    assert resumed.state.step == 8
    assert_same_weights(straight, resumed)


# ----------------------------------------------------------------------------- loading


def test_a_lora_run_loads_as_base_plus_adapters_and_refuses_a_changed_base(
    base: Path, tmp_path: Path
) -> None:
    own_base = tmp_path / "base"
    shutil.copytree(base / "run", own_base)
    cfg = lora_config(base, tmp_path / "run", max_steps=2, ckpt_every=2, eval_every=2)
    cfg.train.init_from = str(own_base)
    trainer = run_trainer(cfg)
    loaded = load_checkpoint(tmp_path / "run")
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert_same_function(loaded.model(x)[0], trainer.model.eval()(x)[0])
    assert loaded.adapters is not None and all(is_adapter(k) for k in loaded.adapters)

    # the base changes: every command that loads the run refuses it, naming it
    ckpt = own_base / "checkpoints" / "step_000004"
    weights = load_model_state(ckpt)
    weights["norm.weight"] = weights["norm.weight"] + 1.0
    state = read_state(ckpt)
    shutil.rmtree(own_base / "checkpoints")
    save_checkpoint(own_base, 4, weights, {"step": 4}, {"config": state["config"]})
    with pytest.raises(UserError, match=f"{ckpt}: the LoRA base .* has changed"):
        load_checkpoint(tmp_path / "run")
    result = runner.invoke(app, ["eval", "--ckpt", str(tmp_path / "run")])
    assert "has changed" in error_line(result) and str(ckpt) in error_line(result)
    # a resume refuses it too
    cfg.train.max_steps = 4
    with pytest.raises(UserError, match="train.init_from: .*has changed"):
        make_trainer(cfg, verbose=False)

    shutil.rmtree(own_base)  # gone: refused, naming it
    result = runner.invoke(
        app, ["sample", "--ckpt", str(tmp_path / "run"), "--max-new-tokens", "2"]
    )
    line = error_line(result)
    assert "LoRA base" in line and "missing" in line and str(ckpt) in line


def test_train_tokens_train_those_embedding_rows_and_round_trip_through_peft(
    base: Path, tmp_path: Path
) -> None:
    """train.lora.train_tokens: a base's rows for chat tokens train beside the adapters (a tied
    head's with them), nothing else of the base moves, and peft's trainable tokens load them."""
    peft = pytest.importorskip("peft")
    import transformers

    from minillm.model.lora import TokenRows
    from minillm.tokenizer.bpe import load_tokenizer
    from minillm.train.objectives.common import Reference

    tokens = ["<|end|>", "<|user|>"]
    ids = [load_tokenizer(base / "run" / "tokenizer.json").token_to_id(t) for t in tokens]
    base_weights = load_model_state(next((base / "run" / "checkpoints").glob("step_000004")))
    cfg = lora_config(base, tmp_path / "run", max_steps=3, ckpt_every=3, eval_every=3, lr=5e-2)
    cfg.train.lora.train_tokens = tokens
    trainer = make_trainer(cfg, verbose=False)
    try:
        x = torch.randint(0, 300, (2, 16))
        x[:, ::3] = ids[0]  # the trained rows are read
        base_net = use_cpu_kernels(Transformer(cfg.model)).eval()
        base_net.load_state_dict(base_weights)
        with torch.no_grad():
            assert torch.equal(trainer.model.eval()(x)[0], base_net(x)[0])  # step 0: the base
        trainer.model.train()
        trainer.fit()
    finally:
        trainer.close()
    model = trainer.model.eval()
    assert isinstance(model.tok_emb, TokenRows) and model.tok_emb.token_ids.tolist() == ids
    assert torch.equal(model.tok_emb.base.weight, base_weights["tok_emb.weight"])  # frozen
    moved = (model.tok_emb.weight != base_weights["tok_emb.weight"]).any(dim=1)
    assert moved.nonzero().flatten().tolist() == sorted(ids)  # those rows, and only those
    with torch.no_grad(), Reference(model, lora=True).model() as reference:  # DPO's, GRPO's
        assert torch.equal(reference(x)[0], base_net(x)[0])  # adapters and rows off: the base
    saved = load_model_state(tmp_path / "run" / "checkpoints" / "step_000003")
    assert saved["tok_emb.token_ids"].tolist() == ids and "tok_emb.token_rows" in saved
    loaded = load_checkpoint(tmp_path / "run")  # base + adapters + rows, merged
    with torch.no_grad():
        ours = model(x)[0]
        assert_same_function(loaded.model(x)[0], ours)

    # peft: the adapters and trainable_token_indices onto the HF export of the (tied) base
    hf_base = tmp_path / "hf"
    result = runner.invoke(app, ["export", "--ckpt", str(base / "run"), "--out", str(hf_base)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "adapter"
    result = runner.invoke(
        app, ["export", "--ckpt", str(tmp_path / "run"), "--format", "peft", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "adapter_config.json").read_text())["trainable_token_indices"] == ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf, out).eval()(x).logits
    assert_same_function(theirs, ours)

    # a token the tokenizer lacks: one error line naming it, nothing written
    path = tmp_path / "bad.yaml"
    raw = {"data": yaml.safe_load((base / "cfg.yaml").read_text())["data"],
           "train": {"init_from": str(base / "run"), "out_dir": str(tmp_path / "bad"),
                     "seq_len": 32, "lora": {"rank": 4, "train_tokens": ["<|nope|>"]}}}  # fmt: skip
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    line = error_line(runner.invoke(app, ["train", str(path)]))
    assert line.startswith("error: train.lora.train_tokens: '<|nope|>' is not a token of"), line
    assert not (tmp_path / "bad").exists()


def test_a_chat_lora_on_a_base_that_never_saw_the_chat_tokens_is_warned(capsys) -> None:  # noqa: ANN001
    """Their head rows all one vector (what pretraining without them leaves): a warning that
    names train.lora.train_tokens; none with distinct rows, on text, or with the key set."""
    from minillm.model.lora import warn_unseen_chat_tokens

    class Tok:
        def token_to_id(self, token: str) -> int | None:
            return {"<|user|>": 5, "<|assistant|>": 6, "<|end|>": 7}.get(token)

    net = random_model()
    on, off = LoRAConfig(**LORA), LoRAConfig(**LORA, train_tokens=["<|end|>"])
    for lora, chat in ((on, True), (on, False), (off, True)):
        warn_unseen_chat_tokens(net, lora, Tok(), chat)
    assert capsys.readouterr().err == ""  # distinct rows: a base that saw them
    with torch.no_grad():
        net.head_weight[5:8] = net.head_weight[9] * torch.tensor([[0.5], [1.0], [2.0]])
    warn_unseen_chat_tokens(net, on, Tok(), True)
    err = capsys.readouterr().err
    assert "train.lora.train_tokens: the base never learned to predict <|user|>" in err
    for lora, chat in ((on, False), (off, True)):
        warn_unseen_chat_tokens(net, lora, Tok(), chat)
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("lora", "init_from", "expected"),
    [
        ({"rank": -1}, True, "train.lora.rank: must be >= 0"),
        (
            {"rank": 4, "targets": ["wqkv", "q_proj"]},
            True,
            "train.lora.targets: 'q_proj' is peft's name; minillm's layer for q_proj/k_proj/v_proj "
            "is 'wqkv'",
        ),
        ({"rank": 4, "alpha": "sixteen"}, True, "train.lora.alpha: expected a number"),
        ({"rank": 4, "alpha": True}, True, "train.lora.alpha: expected a number"),
        ({"rank": 4}, False, "train.lora.rank: 4 needs train.init_from"),
        ({"rnak": 4}, True, "train.lora.rnak: unknown key; did you mean train.lora.rank?"),
    ],
)
def test_a_bad_lora_section_is_one_error_line_and_nothing_written(
    base: Path, tmp_path: Path, lora: dict, init_from: bool, expected: str
) -> None:
    train = {"out_dir": str(tmp_path / "run"), "lora": lora}
    if init_from:
        train["init_from"] = str(base / "run")
    raw = {
        "data": {"out_dir": str(base / "tokens"), "vocab_size": 300},
        "train": train,
    }
    if not init_from:
        raw["model"] = {"d_model": 32, "n_layer": 2, "n_head": 4}
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    for command in (["train", str(path)], ["info", str(path)]):
        line = error_line(runner.invoke(app, command))
        assert line.startswith(f"error: {path}: {expected}"), line
    assert not (tmp_path / "run").exists()


def test_lora_keys_take_set_overrides(base: Path, tmp_path: Path) -> None:
    train = {"init_from": str(base / "run"), "seq_len": 32}
    raw = {"data": {"out_dir": str(base / "tokens")}, "train": train}
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    result = runner.invoke(app, ["train", str(path), "--set", "train.lora.rank=x"])
    assert error_line(result) == "error: --set: train.lora.rank: expected an integer, got 'x'"
    result = runner.invoke(app, ["info", str(path), "--json", "--set", "train.lora.rank=2",
                                 "--set", "train.lora.targets=[wo]"])  # fmt: skip
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    base_params = info["params_frozen"]
    assert info["params_trainable"] == 2 * (2 * 32 + 32 * 2)  # wo of 2 layers: A (2, 32), B (32, 2)
    assert info["params"] == base_params + info["params_trainable"]
    memory = info["memory_bytes"]
    assert memory["grads"] == 4 * info["params_trainable"]
    assert memory["optimizer_state"] == 8 * info["params_trainable"]
    result = runner.invoke(app, ["info", str(path), "--set", "train.lora.rank=2"])
    assert "LoRA rank 2" in result.stdout and f"{base_params:,} frozen" in result.stdout


# ----------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def hf_lora(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A LoRA run on a Hugging Face folder of another shape (untied head, GQA 4/2): the folder,
    the run directory and the trained model, unmerged (adapters trained at a high lr, so that
    merging is far from a no-op)."""
    root = tmp_path_factory.mktemp("lora-hf")
    run_dir, _, _ = make_run(root, model=dict(tie_embeddings=False, n_kv_head=2))
    result = runner.invoke(app, ["export", "--ckpt", str(run_dir), "--out", str(root / "hf")])
    assert result.exit_code == 0, result.output
    raw = {
        "data": {"source": str(root / "sft.jsonl"), "out_dir": str(root / "tokens")},
        "train": {"init_from": str(root / "hf"), "out_dir": str(root / "lora"), "lr": 5e-2,
                  "lora": {"rank": 4, "alpha": 8, "targets": ["wqkv", "wo", "w_gate_up", "w_down"]},
                  **{k: v for k, v in QUICK_TRAIN.items() if k != "lr"}},
    }  # fmt: skip
    path = root / "lora.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    cfg = load_run_config(path)
    write_shards(
        cfg, [SHAKESPEARE.read_text(encoding="utf-8")[i : i + 900] for i in range(0, 27_000, 900)]
    )
    return root / "hf", root / "lora", run_trainer(cfg).model.eval()


def test_hf_and_gguf_exports_of_a_lora_run_are_merged(hf_lora, tmp_path: Path) -> None:
    import transformers

    hf_base, run, unmerged = hf_lora
    result = runner.invoke(app, ["export", "--ckpt", str(run), "--out", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    idx = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        ours = unmerged(idx)[0]
        assert_same_function(hf.eval()(idx).logits, ours)
        assert (base.eval()(idx).logits - ours).abs().max() > 1e-2  # the adapters matter
    out = tmp_path / "m.gguf"
    result = runner.invoke(
        app, ["export", "--ckpt", str(run), "--format", "gguf", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (make interop)")
    from llama_cpp import Llama

    ids = idx[0].tolist()
    llm = Llama(model_path=str(out), n_ctx=64, n_batch=64, n_ubatch=64, n_threads=2,
                logits_all=True, type_k=0, type_v=0, verbose=False)  # fmt: skip
    llm.eval(ids)
    theirs = torch.tensor(llm.scores[: len(ids)])
    rel = (theirs - ours[0]).abs().max() / (ours[0].max() - ours[0].min())
    assert rel <= 1e-4  # tests/test_gguf.py's bound for f32 weights and an f32 KV cache


def test_the_peft_export_loads_in_peft_onto_the_hf_base(hf_lora, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    import transformers
    from safetensors.torch import load_file

    hf_base, run, unmerged = hf_lora
    out = tmp_path / "adapter"
    result = runner.invoke(
        app, ["export", "--ckpt", str(run), "--format", "peft", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["target_modules"] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    ]  # fmt: skip
    names = load_file(out / "adapter_model.safetensors")
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in names
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in names
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, out).eval()
    idx = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        assert_same_function(model(idx).logits, unmerged(idx)[0])

    # a run that is not LoRA has no adapters: one error line, nothing written
    result = runner.invoke(
        app, ["export", "--ckpt", str(hf_base), "--format", "peft", "--out", str(tmp_path / "x")]
    )
    assert "is not a LoRA run" in error_line(result)
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- chat fine-tuning


def test_chat_fine_tuning_with_lora_keeps_answer_only_loss_and_doc_masking(
    base: Path, tmp_path: Path
) -> None:
    """LoRA on chat data: assistant-only targets and windows masked per conversation, as any chat
    SFT; then `chat` and `eval --task` take the run as they take any."""
    chats = tmp_path / "chats.jsonl"
    lines = (ROOT / "data" / "tiny_chat.jsonl").read_text(encoding="utf-8").splitlines()[:300]
    chats.write_text("\n".join(lines) + "\n", encoding="utf-8")
    task = tmp_path / "task.jsonl"
    tests = (ROOT / "data" / "tiny_chat_test.jsonl").read_text(encoding="utf-8").splitlines()[:3]
    task.write_text("\n".join(tests) + "\n", encoding="utf-8")
    raw = {
        "data": {"source": str(chats), "text_field": "messages", "out_dir": str(tmp_path / "tok")},
        "train": {"init_from": str(base / "run"), "out_dir": str(tmp_path / "run"),
                  "lora": {"rank": 8, "alpha": 16}, **QUICK_TRAIN, "max_steps": 10, "lr": 5e-2,
                  "eval_every": 10},
    }  # fmt: skip
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    assert runner.invoke(app, ["tokenize", str(path)]).exit_code == 0
    cfg = load_run_config(path)
    trainer = make_trainer(cfg, verbose=False)
    try:
        assert trainer.objective.packing.chat and trainer.objective.packing.doc_mask
        micro = trainer.batches(0)[0]
        assert micro.doc_ids is not None  # attention stays inside a conversation
        targets = micro.targets[micro.targets != -100]
        assert 0 < targets.numel() < micro.targets.numel() // 2  # the assistant's tokens only
        before = trainer.evaluate()["loss"]  # step 0: the base, on the assistant tokens
        trainer.fit()
    finally:
        trainer.close()
    # the adapters moved the function (this 4-step base, random embeddings frozen, learns little)
    assert abs(trainer.last_eval["loss"] - before) > 1e-3
    chat = ["--message", "Copy: a b c", "--max-new-tokens", "4", "--temperature", "0"]
    result = runner.invoke(app, ["chat", "--ckpt", str(tmp_path / "run"), *chat])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["eval", "--ckpt", str(tmp_path / "run"), "--task", str(task),
                                 "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tasks"]["task"]["examples"] == 3


def test_bench_lora_prints_full_and_lora_rows(monkeypatch, capsys) -> None:  # noqa: ANN001
    bench = load_script("bench_lora", monkeypatch)
    rows = bench.main(["--shapes", "tiny", "--steps", "1", "--ranks", "4"])
    full, lora = rows
    assert full["frozen"] == 0 and full["trainable"] == lora["frozen"]
    assert lora["trainable"] == 2 * 4 * (64 + 192 + 64 + 64 + 64 + 2 * 256 + 256 + 64)
    assert 0 < lora["peak_bytes"] < full["peak_bytes"]
    out = capsys.readouterr().out
    assert "| full fine-tuning |" in out and "| LoRA rank 4 |" in out


def test_a_mixture_of_experts_takes_attention_adapters_only() -> None:
    from minillm.errors import ConfigError

    moe = tiny_model_config(vocab_size=97, n_experts=2)
    with pytest.raises(ConfigError, match="train.lora.targets: w_gate_up: this model has no"):
        add_lora(Transformer(moe), LoRAConfig(rank=4))
    net = add_lora(Transformer(moe), LoRAConfig(rank=4, targets=["wqkv", "wo"]))
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 * moe.n_layer and all(is_adapter(n) for n in trainable)
    idx = torch.randint(0, 97, (1, 8))
    with torch.no_grad():
        before = net(idx)[0]
        assert torch.equal(merge_lora(net)(idx)[0], before)  # B = 0: merging adds nothing
