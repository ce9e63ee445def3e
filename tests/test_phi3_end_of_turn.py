"""Phi-3's end of a chat turn (`<|end|>`) comes from one place, the family
(minillm.families.phi3 `end_of_turn`, `turn_end`, applied by `model_conventions`), on every path
that samples, chats, serves or scores a Phi-3 model: a folder by --ckpt (or a hub name, which
resolves to one), a run's checkpoint, a run's probes and objectives. The folder here is
Phi-3-mini's shape (scripts/make_published_folder.py `phi3-mini`: Phi3ForCausalLM, Llama 2's
sentencepiece with Phi-3's special tokens and template) with the tokenizer.json of the published
Phi-3: `<|end|>`, `<|assistant|>`, `<|user|>` and `<|system|>` strip the whitespace after them
(`rstrip`), so the newline the template writes after `<|end|>` is part of that token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.families import FAMILIES
from tests.published import family_folder, hf_tokenizer
from tests.test_phi3_cli import CHAT, LONG, _greedy, _hf
from tests.test_published_models import hf_ids

runner = CliRunner()
STRIPPING = ("<|end|>", "<|assistant|>", "<|user|>", "<|system|>")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Phi-3-mini folder whose greedy reply to CHAT ends at <|end|> after a few tokens, as
    transformers' generate does with its generation_config.json (eos [<|end|>, <|endoftext|>]):
    <|end|>'s head row is the row of the reply's third token, scaled up."""
    root = tmp_path_factory.mktemp("phi3-eot")
    path = family_folder(root, "phi3-mini")
    tok_file = path / "tokenizer.json"
    raw = json.loads(tok_file.read_text(encoding="utf-8"))
    for added in raw["added_tokens"]:
        if added["content"] in STRIPPING:
            added["rstrip"] = True
    tok_file.write_text(json.dumps(raw), encoding="utf-8")
    model, tok = _hf(path), hf_tokenizer(path)
    prompt = hf_ids(tok, CHAT, True)
    reply = _greedy(model, prompt, 12)
    end = tok.convert_tokens_to_ids("<|end|>")
    with torch.no_grad():
        ids = torch.tensor([prompt + reply[:2]])
        logits = model(ids).logits[0, -1]
        head = model.lm_head.weight
        head[end] = head[reply[2]] * (2.0 if logits[reply[2]] > 0 else -2.0)  # its logit doubled
    model.save_pretrained(path)
    return path


def end_id(folder: Path) -> int:
    return hf_tokenizer(folder).convert_tokens_to_ids("<|end|>")


def without_generation_config(folder: Path, root: Path) -> Path:
    """The folder with no generation_config.json (config.json's eos is <|endoftext|> alone)."""
    other = root / "no-gen"
    shutil.copytree(folder, other)
    (other / "generation_config.json").unlink()
    config = json.loads((other / "config.json").read_text())
    config["eos_token_id"] = hf_tokenizer(other).convert_tokens_to_ids("<|endoftext|>")
    (other / "config.json").write_text(json.dumps(config))
    return other


def test_the_turn_end_of_a_template_whose_end_token_strips_the_newline(folder: Path) -> None:
    """The template probe finds <|end|> after a reply although the token spans the newline the
    template writes after it: the turn end exports write (GGUF's end-of-turn id) and the stops."""
    conv = load_checkpoint(folder).conventions
    assert conv.turn_end == end_id(folder)
    assert end_id(folder) in conv.stop_ids
    assert conv.special_ids(folder).eot == end_id(folder)


def test_chat_stops_at_end_as_transformers_generate(folder: Path) -> None:
    """`chat --ckpt DIR` replies transformers' greedy tokens and stops where its generate stops
    (at <|end|>, before the token limit)."""
    tok = hf_tokenizer(folder)
    reply = _greedy(_hf(folder), hf_ids(tok, CHAT, True), 12)
    assert reply[-1] == end_id(folder) and len(reply) < 12, reply
    args = ["chat", "--ckpt", str(folder), "--system", "Be brief.", "--message", LONG]
    result = runner.invoke(app, [*args, "--max-new-tokens", "12", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert result.stdout == tok.decode(reply, skip_special_tokens=True) + "\n"


def test_every_path_reads_the_familys_end_of_turn(folder: Path, tmp_path: Path) -> None:
    """Without a generation_config.json, the family's end_of_turn ids are the stops of the
    folder's load, of a run's checkpoint holding its tokenizer, and of a run's training probes
    and objectives (sample_every, GRPO's rollouts), all read through model_conventions."""
    from minillm.checkpoint.hf_import import read_hf_checkpoint
    from minillm.checkpoint.save import save_checkpoint
    from minillm.config import config_to_dict
    from minillm.train.distributed import DistInfo
    from minillm.train.objectives.common import Setup
    from minillm.train.probes import TrainingProbes

    bare = without_generation_config(folder, tmp_path)
    tok = hf_tokenizer(bare)
    family = {tok.convert_tokens_to_ids(t) for t in FAMILIES["phi3"].end_of_turn}
    loaded = load_checkpoint(bare)
    assert loaded.conventions.stop_ids == family
    run = tmp_path / "run"
    save_checkpoint(run, step=1, model_state=loaded.model.state_dict(), trainer_state={},
                    state={"config": config_to_dict(loaded.config)},
                    tokenizer_file=bare / "tokenizer.json")  # fmt: skip
    assert load_checkpoint(run).conventions.stop_ids == family
    cfg, _ = read_hf_checkpoint(bare)
    setup = Setup(cfg, DistInfo(), torch.device("cpu"), False)
    assert setup.conventions.stop_ids == family
    assert setup.conventions.turn_end == end_id(bare)
    import dataclasses

    sampling = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, sample_every=1))
    probes = TrainingProbes.create(sampling, bare / "tokenizer.json", torch.device("cpu"))
    assert probes is not None and probes.conv.stop_ids == family


def test_transformers_stops_there_too(folder: Path, tmp_path: Path) -> None:
    """The stop set above is transformers' generate's for the published Phi-3's eos ids: the
    folder's generation_config.json lists <|end|>, and transformers stops at it."""
    gen = transformers.GenerationConfig.from_pretrained(folder)
    assert end_id(folder) in gen.eos_token_id
