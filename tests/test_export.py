"""HF folders: export loads in transformers with our logits and ids; import gives HF's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from minillm.checkpoint.hf_export import export_checkpoint
from minillm.checkpoint.hf_import import import_hf_folder
from minillm.checkpoint.init_from import load_run_config
from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.errors import CheckpointError, UserError
from minillm.families import hf_config_dict
from minillm.infer.engine import SamplingParams, generate
from minillm.model import Transformer
from minillm.tokenizer.bpe import EOT, eot_id
from tests.helpers import assert_same_function, make_run, tiny_tokenizer

TEXT = "First Citizen:\nBefore we proceed — Grüße, 日本語 🙂 <|endoftext|> the end."


@pytest.fixture(scope="module", params=["tied", "untied"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(f"export-{request.param}")
    model_kw = dict(tie_embeddings=request.param == "tied", rope_theta=5000.0, norm_eps=1e-6)
    run_dir, _, _ = make_run(root, model=model_kw, sample=dict(temperature=0.7, top_k=20))
    loaded = load_checkpoint(run_dir)
    out = export_checkpoint(loaded, root / "hf")
    return loaded, out


def test_exported_folder_has_the_hf_files(exported) -> None:
    loaded, out = exported
    names = {p.name for p in out.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    }
    assert not list(out.parent.glob(".hf.*"))  # no temporary folder left behind
    # the weights are as readable as the other files (safetensors alone would make them 0600)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == (
        out / "config.json"
    ).stat().st_mode & 0o777
    cfg = json.loads((out / "config.json").read_text())
    m = loaded.config.model
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_key_value_heads"], cfg["rms_norm_eps"], cfg["rope_theta"]) == (2, 1e-6, 5000)
    assert cfg["tie_word_embeddings"] == m.tie_embeddings and cfg["vocab_size"] == m.vocab_size
    eot = eot_id(loaded.tokenizer)
    gen = json.loads((out / "generation_config.json").read_text())
    end = loaded.tokenizer.token_to_id("<|end|>")  # a chat turn ends generation too
    assert gen["eos_token_id"] == [eot, end] and gen["do_sample"] and gen["top_k"] == 20
    assert gen["max_new_tokens"] == 20 and "max_length" not in gen


def test_transformers_loads_our_logits_and_token_ids(exported) -> None:
    loaded, out = exported
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    idx = torch.randint(0, loaded.config.model.vocab_size, (2, 40))
    with torch.no_grad():
        ours, _ = loaded.model(idx)
        ref = hf(idx).logits
    assert_same_function(ref, ours)

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = TEXT.replace("<|endoftext|>", "")  # HF always treats the literal as the special token
    ours_ids = loaded.tokenizer.encode(text).ids
    assert hf_tok(text)["input_ids"] == ours_ids
    assert hf_tok.decode(ours_ids) == text
    eot = eot_id(loaded.tokenizer)
    assert hf_tok.eos_token == hf_tok.bos_token == hf_tok.pad_token == EOT
    assert hf_tok.eos_token_id == eot


def test_greedy_generation_equals_hf_generate(exported) -> None:
    loaded, out = exported
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    eot = eot_id(loaded.tokenizer)
    prompts = [[eot, 40, 41, 42, 43, 44, 45, 46], [eot, 100, 7]]
    ours = generate(loaded.model, prompts, SamplingParams.greedy(30, stop_ids=frozenset([eot])))
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=eot
            )
        assert got == ref[0, len(prompt) :].tolist()
    # HF's own left-padded batch agrees as well.
    T = max(map(len, prompts))
    idx = torch.tensor([[eot] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = hf.generate(
            idx, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eot
        )
    for r, got in enumerate(ours):
        assert ref[r, T : T + len(got)].tolist() == got


def test_exported_end_of_text_row_still_learns_in_transformers(exported) -> None:
    loaded, out = exported
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).train()
    assert hf.model.embed_tokens.padding_idx is None
    eot = eot_id(loaded.tokenizer)
    torch.manual_seed(0)
    idx = torch.randint(0, 300, (2, 24))
    idx[:, ::5] = eot  # documents joined by end-of-text, as in pretraining data
    ours = Transformer(loaded.config.model)
    ours.load_state_dict(loaded.model.state_dict())
    _, loss = ours.train()(idx, idx)
    loss.backward()
    hf(input_ids=idx, labels=idx, shift_labels=idx).loss.backward()
    ref = hf.model.embed_tokens.weight.grad[eot]
    assert ref.abs().sum() > 0
    assert_same_function(ref, ours.tok_emb.weight.grad[eot])


def test_chat_template_and_replies_match_hf(exported) -> None:
    """apply_chat_template gives our ids; greedy HF generate gives `chat --message`'s reply."""
    loaded, out = exported
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Grüße! What is 2 + 2?"},
        {"role": "assistant", "content": "4 🙂"},
        {"role": "user", "content": " And 3+3?\n"},
    ]
    ours = loaded.conventions.chat_ids(messages, add_generation_prompt=True)
    theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs  # newer: a BatchEncoding
    assert list(theirs) == ours
    assert hf_tok.apply_chat_template(messages, tokenize=False).count("<|end|>") == 4

    args = ["chat", "--ckpt", str(loaded.path), "--temperature", "0", "--max-new-tokens", "15"]
    reply = CliRunner().invoke(app, [*args, "--system", "You are terse.", "--message", "Hi"])
    assert reply.exit_code == 0, reply.output
    prompt = hf_tok.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():  # generation_config stops at <|end|>; the padded rows are no tokens
        ref = hf.generate(
            **prompt,
            max_new_tokens=15,
            do_sample=False,
            suppress_tokens=list(range(hf_tok.vocab_size, loaded.config.model.vocab_size)),
        )
    new = ref[0, prompt["input_ids"].shape[1] :]
    assert reply.stdout == hf_tok.decode(new, skip_special_tokens=True) + "\n"


def test_export_refuses_a_non_empty_folder_unless_forced(tmp_path: Path) -> None:
    run_dir, _, _ = make_run(tmp_path)
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    runner = CliRunner()
    result = runner.invoke(app, ["export", "--ckpt", str(run_dir), "--out", str(target)])
    assert result.exit_code == 2 and "--force" in result.stderr
    assert (target / "keep.txt").read_text() == "mine"
    args = ["export", "--ckpt", str(run_dir), "--out", str(target), "--force"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (target / "model.safetensors").is_file() and not (target / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        runner.invoke(app, ["export", "--ckpt", str(run_dir), "--out", str(empty)]).exit_code == 0
    )


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_export_force_never_deletes_the_run_or_a_folder_of_folders(tmp_path: Path) -> None:
    run_dir, _, _ = make_run(tmp_path / "work")
    step = run_dir / "checkpoints" / "step_000010"
    assert step.is_dir()
    before = _tree(tmp_path)
    runner = CliRunner()
    for ckpt, out in [
        (run_dir, run_dir),  # the run itself
        (run_dir, run_dir / "checkpoints"),
        (run_dir, step),  # a checkpoint of the run
        (step, step),
        (step, run_dir),  # the run that holds the checkpoint
        (run_dir, tmp_path / "work"),  # a folder that holds the run
    ]:
        args = ["export", "--ckpt", str(ckpt), "--out", str(out), "--force"]
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (ckpt, out, result.output)
        assert len(result.stderr.strip().splitlines()) == 1
        assert _tree(tmp_path) == before, (ckpt, out)
    home = tmp_path / "home"
    (home / "photos").mkdir(parents=True)
    result = runner.invoke(app, ["export", "--ckpt", str(run_dir), "--out", str(home), "--force"])
    assert result.exit_code == 2 and "holds folders" in result.stderr
    assert (home / "photos").is_dir()
    inside = run_dir / "hf"  # next to the checkpoints is fine
    result = runner.invoke(app, ["export", "--ckpt", str(run_dir), "--out", str(inside)])
    assert result.exit_code == 0, result.output


# ----------------------------------------------------------------------------- import


def hf_folder(
    root: Path, tie: bool = False, **save_kw
) -> tuple[Path, transformers.PreTrainedModel]:
    """A tiny LlamaForCausalLM with random weights saved by transformers, plus our tokenizer."""
    from minillm.config import ModelConfig

    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=320, d_model=64, n_layer=2, n_head=4, n_kv_head=1,
                      ffn_hidden=96, max_seq_len=64, tie_embeddings=tie, rope_theta=500.0,
                      norm_eps=1e-5)  # fmt: skip
    hf_cfg = hf_config_dict(cfg, bos_id=0, eos_id=0)
    for key in ("architectures", "model_type", "torch_dtype"):
        hf_cfg.pop(key)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    folder = root / "hf"
    hf.save_pretrained(folder, **save_kw)
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    return folder, hf


@pytest.mark.parametrize("tie", [False, True])
def test_import_gives_hf_logits(tmp_path: Path, tie: bool) -> None:
    folder, hf = hf_folder(tmp_path, tie=tie)
    cfg, state, tok_path = import_hf_folder(folder)
    assert (
        cfg.tie_embeddings == tie and cfg.n_kv_head == 1 and tok_path == folder / "tokenizer.json"
    )
    assert (cfg.rope_theta, cfg.norm_eps) == (500.0, 1e-5)
    model = Transformer(cfg).eval()
    model.load_state_dict(state)
    idx = torch.randint(0, 320, (2, 30))
    with torch.no_grad():
        assert_same_function(model(idx)[0], hf(idx).logits)


def test_import_reads_sharded_safetensors(tmp_path: Path) -> None:
    folder, hf = hf_folder(tmp_path, max_shard_size="60KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    cfg, state, _ = import_hf_folder(folder)
    model = Transformer(cfg).eval()
    model.load_state_dict(state)
    idx = torch.randint(0, 320, (1, 20))
    with torch.no_grad():
        assert_same_function(model(idx)[0], hf(idx).logits)


def test_round_trip_export_then_import_is_exact(tmp_path: Path) -> None:
    run_dir, cfg, net = make_run(tmp_path, model=dict(tie_embeddings=False))
    out = export_checkpoint(load_checkpoint(run_dir), tmp_path / "hf")
    got_cfg, state, _ = import_hf_folder(out)
    assert got_cfg.n_kv_head == cfg.model.n_kv_head and got_cfg.ffn_hidden == cfg.model.ffn_hidden
    own = net.state_dict()
    assert set(state) == set(own) and all(torch.equal(state[k], own[k]) for k in own)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj))


def _break_truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _break_gpt2(folder: Path) -> None:
    _write_json(
        folder / "config.json", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    )


def _break_bin_only(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")


def _break_missing_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(folder / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, folder / "model.safetensors")


def _break_shape(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    _write_json(folder / "config.json", dict(cfg, intermediate_size=128))


def _break_shard(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (folder / sorted(set(index["weight_map"].values()))[-1]).unlink()


def _break_rope_scaling(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    rope = {"rope_type": "longrope", "rope_theta": 500.0, "factor": 8.0}
    _write_json(folder / "config.json", dict(cfg, rope_parameters=rope))


def _break_no_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()


@pytest.mark.parametrize(
    "breaker, message",
    [
        (lambda f: (f / "config.json").unlink(), "no config.json; not a Hugging Face model folder"),
        (_break_gpt2, "'gpt2' model (GPT2LMHeadModel), not one of the architectures minillm"),
        (_break_truncate, "model.safetensors: not a readable safetensors file"),
        (_break_bin_only, "pytorch_model.bin (pickle) weights only"),
        (_break_missing_tensor, "model.layers.1.mlp.up_proj.weight is missing"),
        (_break_shape, "weights do not fit the model: shape mismatch"),
        (_break_rope_scaling, "rope_type 'longrope' is not supported"),
        (_break_no_tokenizer, "no tokenizer.json"),
    ],
)
def test_import_refuses_broken_folders_clearly(tmp_path: Path, breaker, message: str) -> None:
    folder, _ = hf_folder(tmp_path)
    breaker(folder)
    with pytest.raises(UserError) as err:
        import_hf_folder(folder)
    assert message in str(err.value)
    assert isinstance(err.value, CheckpointError) or "config.json" in str(err.value)


def test_import_refuses_a_missing_shard(tmp_path: Path) -> None:
    folder, _ = hf_folder(tmp_path, max_shard_size="60KB")
    _break_shard(folder)
    with pytest.raises(CheckpointError, match="shard model-.* is missing"):
        import_hf_folder(folder)


def test_a_run_starts_from_an_exported_folder_without_a_model_section(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import yaml

    from minillm.config import load_config
    from tests.helpers import make_trainer, write_shards

    run_dir, cfg, net = make_run(tmp_path / "a")
    hf_dir = export_checkpoint(load_checkpoint(run_dir), tmp_path / "hf")
    raw = {
        "data": dict(source=str(tmp_path / "corpus.jsonl"), vocab_size=cfg.data.vocab_size,
                     tokenizer=str(hf_dir / "tokenizer.json"), out_dir=str(tmp_path / "tok")),
        "train": dict(out_dir=str(tmp_path / "run2"), init_from=str(hf_dir), batch_size=2,
                      seq_len=16, max_steps=1, device="cpu", precision="fp32"),
    }  # fmt: skip
    path = tmp_path / "init.yaml"
    path.write_text(yaml.safe_dump(raw))
    new = load_run_config(path)  # no model section: the folder's config.json gives it
    assert Transformer(new.model).param_count() == net.param_count()
    write_shards(new, [TEXT * 20, "Second document, long enough to train on. " * 20] * 3)
    trainer = make_trainer(new, verbose=False)
    try:
        got = trainer.model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in net.state_dict().items())
    finally:
        trainer.close()
    assert "warning" not in capsys.readouterr().err
    raw["model"] = dict(d_model=32, n_layer=1, n_head=2)  # a model section that is not used
    raw["train"]["out_dir"] = str(tmp_path / "run3")
    path.write_text(yaml.safe_dump(raw))
    with_model = load_run_config(path)
    err = capsys.readouterr().err
    assert "model.d_model, model.n_layer, model.n_head" in err and "not used" in err
    assert with_model.model == new.model  # the folder's, not the section's
    make_trainer(with_model, verbose=False).close()
    # A config built without load_run_config (which resolves init_from, once) keeps its own
    # model: the folder's weights do not fit it, one error naming the weights file and the tensors.
    with pytest.raises(
        CheckpointError, match=f"{hf_dir}/model.safetensors: weights do not fit the model: .*shape"
    ):
        make_trainer(load_config(path), verbose=False)


def test_shards_made_with_the_original_tokenizer_accept_its_exported_copy(tmp_path: Path) -> None:
    import copy

    from minillm.runtime.files import sha256_file
    from minillm.tokenizer.bpe import tokenizer_sha256
    from tests.helpers import make_trainer, write_shards

    run_dir, cfg, _ = make_run(tmp_path)
    hf_dir = export_checkpoint(load_checkpoint(run_dir), tmp_path / "hf")
    original, exported = Path(cfg.data.tokenizer), hf_dir / "tokenizer.json"
    assert original.read_bytes() != exported.read_bytes()  # pretty-printed by the export
    assert tokenizer_sha256(exported) == tokenizer_sha256(original) == sha256_file(original)
    write_shards(cfg, [TEXT * 20, "Second document, long enough to train on. " * 20] * 3)
    new = copy.deepcopy(cfg)
    new.data.tokenizer = str(exported)
    new.train.init_from, new.train.out_dir = str(hf_dir), str(tmp_path / "run2")
    new.train.device, new.train.max_steps = "cpu", 1
    make_trainer(new, verbose=False).close()  # no "shards were made with another tokenizer"
