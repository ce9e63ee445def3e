"""The tests' one factory of tiny configs and runs, and the helpers around them.

`tiny_config(root, ...)` is the one tiny config (data under root, the run at root/run); the rest
builds on it: `prepared_config` (its corpus written and tokenized), `run_config`, `trained_run`
(a real 4-step training), `make_run` (a run directory with one checkpoint of a random model, no
training, for the eval, sample and export tests) and `tiny_model_config` (the model section
alone). `tiny_tokenizer()` is a 300-token byte-level BPE trained once per session on a few KB of
Shakespeare plus some non-ASCII text; `write_shards` tokenizes documents with the real pipeline.

`script_tokens` makes the decoding core draw the tokens a test chooses.

Import it as `from tests.helpers import ...` (tests/ is a package), never as `helpers`: one module.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from minillm.checkpoint.store import save_checkpoint
from minillm.config import Config, ModelConfig, config_from_dict, config_to_dict
from minillm.model import Transformer

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT / "data" / "tinyshakespeare.txt"
EXTRA = "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🙂🚀, Ελληνικά.\n"
VOCAB = 300

# The tiny model: 2 layers, 4 query heads over 2 KV heads, 64 positions.
TINY_MODEL: dict[str, Any] = dict(
    d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=64, max_seq_len=64
)
# Twice as wide, for the tests of a model's outputs (make_run, the model fixtures).
WIDE: dict[str, Any] = dict(d_model=64, ffn_hidden=96)
# A short CPU training (8 steps, checkpoints at 4 and 8): the trainer tests' train section.
QUICK_TRAIN: dict[str, Any] = dict(
    batch_size=4,
    seq_len=32,
    max_steps=8,
    lr=1e-2,
    min_lr=1e-3,
    warmup_steps=2,
    eval_every=4,
    eval_steps=2,
    ckpt_every=4,
    log_every=2,
    device="cpu",
    precision="fp32",
)


def tiny_config(root: Path, *, quick_train: bool = True, **sections: dict[str, Any]) -> Config:
    """The tiny config: data at root/corpus.txt tokenized into root/tokens, the run at root/run,
    the model TINY_MODEL; `sections` override keys per section. quick_train: the train section
    is QUICK_TRAIN, else the schema's defaults (as a user's run has them: make_run)."""
    raw: dict[str, dict[str, Any]] = {
        "model": dict(TINY_MODEL),
        "data": dict(
            source=str(root / "corpus.txt"), vocab_size=VOCAB, out_dir=str(root / "tokens")
        ),
        "train": dict(out_dir=str(root / "run"), **(QUICK_TRAIN if quick_train else {})),
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


def tiny_model_config(**overrides: Any) -> ModelConfig:
    """The model section of the tiny config alone (no data, no run): WIDE unless overridden."""
    return ModelConfig(**{**TINY_MODEL, **WIDE, **overrides})


def prepared_config(tmp_path: Path, **sections: dict[str, Any]) -> Config:
    """tiny_config with its corpus written and tokenized."""
    from minillm.data.tokenize_pass import write_shards as tokenize

    text = SHAKESPEARE.read_text(encoding="utf-8")[:60_000]
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    cfg = tiny_config(tmp_path, **sections)
    tokenize(cfg)
    return cfg


def run_config(data_dir: Path, run: Path, model: dict | None = None, **train: Any) -> Config:
    """tiny_config over the corpus tokenized in data_dir, training into `run`."""
    return tiny_config(data_dir, model=model or {}, train=dict(out_dir=str(run), **train))


def trained_run(base: Path) -> Path:
    """A tokenized corpus under `base`, a 4-step run with checkpoints at steps 2 and 4 (BEST names
    one of them) and its config as `base/cfg.yaml`; returns `base`."""
    import yaml

    cfg = prepared_config(base, train=dict(max_steps=4, ckpt_every=2, eval_every=2))
    trainer = make_trainer(cfg, verbose=False)
    try:
        trainer.fit()
    finally:
        trainer.close()
    (base / "cfg.yaml").write_text(yaml.safe_dump(config_to_dict(cfg)))
    return base


def load_script(name: str, monkeypatch: Any) -> Any:
    """scripts/<name>.py as a module (registered in sys.modules for its dataclasses)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_trainer(cfg: Config, stop_at: int | None = None, **kw: Any) -> Any:
    """A quiet Trainer run to max_steps (or `stop_at`), closed; returns the Trainer."""
    trainer = make_trainer(cfg, verbose=False, **kw)
    try:
        trainer.fit(stop_at=stop_at)
    finally:
        trainer.close()
    return trainer


def resumed_runs(
    config: Config | Callable[[Path], Config], root: Path, stop_at: int, **kw: Any
) -> tuple[Any, Any, Any]:
    """The one resume check of every objective and feature: a config (or `config(out)`, one
    training into `out`) trained straight to max_steps at root/straight, and at root/split
    stopped after `stop_at` steps (it checkpoints there) and run again (it resumes); returns the
    three Trainers (straight, stopped, resumed) for `assert_same_weights`, the resumed one checked
    to have resumed and to end where the straight one did."""
    if isinstance(config, Config):
        cfg = config
        config = lambda out: replace(cfg, train=replace(cfg.train, out_dir=str(out)))  # noqa: E731
    straight = run_trainer(config(root / "straight"), **kw)
    stopped = run_trainer(config(root / "split"), stop_at=stop_at, **kw)
    resumed = run_trainer(config(root / "split"), **kw)
    assert resumed.resumed and stopped.state.step == stop_at
    assert resumed.state.step == straight.state.step
    return straight, stopped, resumed


def assert_same_weights(a: Any, b: Any) -> None:
    """Two trainers' models hold the same weights, bit for bit."""
    wa, wb = a.model.state_dict(), b.model.state_dict()
    assert wa.keys() == wb.keys()
    for name, tensor in wa.items():
        assert torch.equal(tensor, wb[name]), name


def make_trainer(
    cfg: Config,
    resume: bool = True,
    force: bool = False,
    verbose: bool = True,
    batches: Callable[[int], list] | None = None,
    config_dir: Path | None = None,
) -> Any:
    """`Trainer(prepare_run(cfg, ...))`, as `minillm train` builds it; `batches(step)` replaces
    the train split's micro-batches (the trainer's `batches` method) for a test that feeds its
    own; config_dir: the config file's folder (a python: reward is looked up there)."""
    from minillm.train.run import prepare_run
    from minillm.train.trainer import Trainer

    run = prepare_run(cfg, resume=resume, force=force, verbose=verbose, config_dir=config_dir)
    trainer = Trainer(run)
    if batches is not None:
        trainer.batches = batches
    return trainer


def weights(trainer: Any) -> dict[str, Any]:
    """A copy of the trainer's model weights."""
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def eval_json(args: list[str]) -> dict:
    """`minillm eval ARGS --json --device cpu` through the CLI in this process, parsed."""
    from typer.testing import CliRunner

    from minillm.cli import app

    result = CliRunner().invoke(app, ["eval", *args, "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def script_tokens(monkeypatch: Any, tokens: list[int]) -> None:
    """From now on the decoding core draws `tokens` in order, whatever the logits: draw k of
    every row is tokens[k] (rows submitted together, e.g. one reply). A reply a test chooses,
    token by token, through the real engine and its stop rules."""
    from minillm.infer import engine

    draws = iter(tokens)

    def scripted(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full((logits.shape[0],), next(draws), dtype=torch.long)

    monkeypatch.setattr(engine, "sample_next", scripted)


def error_line(result) -> str:  # noqa: ANN001
    """The one `error:` line of a failed command (exit 2, nothing else on stderr)."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def assert_set_refused(tmp_path: Path, sets: list[str], expected: str) -> None:
    """`minillm info` on a tiny model config with `--set` values `sets` fails with one error line
    that begins with `expected` (named by `--set` or by the config file)."""
    from typer.testing import CliRunner

    from minillm.cli import app

    path = tmp_path / "model.yaml"
    path.write_text("model: {d_model: 64, n_layer: 2, n_head: 4}\n")
    args = ["info", str(path)] + [a for s in sets for a in ("--set", s)]
    line = error_line(CliRunner().invoke(app, args))
    assert line.startswith(f"error: --set: {expected}") or line.startswith(
        f"error: {path}: {expected}"
    ), line


# ------------------------------------------------------------------ runs without training


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    from minillm.tokenizer.bpe import train_tokenizer

    text = SHAKESPEARE.read_text(encoding="utf-8")[:6000] + EXTRA * 3
    return train_tokenizer([text], VOCAB).to_str()


def legacy_tokenizer_json() -> str:
    """A tokenizer from before minillm reserved the chat tokens (only <|endoftext|>)."""
    from tokenizers import trainers

    from minillm.tokenizer.bpe import EOT, new_tokenizer

    legacy = new_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOT], show_progress=False)
    legacy.train_from_iterator([SHAKESPEARE.read_text(encoding="utf-8")[:6000]], trainer)
    return legacy.to_str()


def tiny_tokenizer() -> Tokenizer:
    tok = Tokenizer.from_str(tokenizer_json())
    tok.encode_special_tokens = True
    return tok


def llama_folder(
    folder: Path, dtype: torch.dtype = torch.bfloat16, max_shard_size: str = "5GB", **shape: Any
) -> Any:
    """A random-weight Hugging Face Llama folder at `folder` (transformers' own class, seed 0,
    untied head): LlamaConfig's `shape` keys (vocab_size, hidden_size, ...), weights in `dtype`
    in shards of at most `max_shard_size`, tiny_tokenizer's tokenizer.json. Returns the model."""
    import transformers

    name = str(dtype).removeprefix("torch.")  # config.json's dtype: what `--dtype auto` reads
    hf_cfg = transformers.LlamaConfig(tie_word_embeddings=False, dtype=name, **shape)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM._from_config(hf_cfg, dtype=dtype)
    hf.save_pretrained(folder, max_shard_size=max_shard_size)
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    return hf


# The ~24M-parameter shape of the memory tests (vocab 32,000: bf16 ~48 MB, fp32 ~96 MB).
LLAMA_24M = dict(
    vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip


def make_run(
    root: Path,
    *,
    model: dict[str, Any] | None = None,
    train: dict[str, Any] | None = None,
    sample: dict[str, Any] | None = None,
    seed: int = 0,
    uniform: bool = False,
    tokenizer: Tokenizer | None = None,
) -> tuple[Path, Config, Transformer]:
    """A run directory at root/run with one checkpoint of a random tiny model; data at root/tokens.

    Weights are drawn with a larger spread than the trainer's init so that logits are far from
    uniform (greedy choices are then robust to 1e-6 differences) and norms are not all ones.
    uniform: all weights zero instead, so every token costs exactly ln(vocab_size) nats.
    tokenizer: the run's tokenizer instead of `tiny_tokenizer()` (model.vocab_size must fit it).
    """
    tok_path = root / "tokenizer.json"
    tok_path.parent.mkdir(parents=True, exist_ok=True)
    text = tokenizer_json() if tokenizer is None else tokenizer.to_str()
    tok_path.write_text(text, encoding="utf-8")
    cfg = tiny_config(
        root,
        quick_train=False,
        # a padded embedding table, as people round vocab up
        model={"vocab_size": VOCAB + 20, **WIDE, **(model or {})},
        data=dict(
            source=str(root / "corpus.jsonl"),
            vocab_size=VOCAB if tokenizer is None else tokenizer.get_vocab_size(),
            tokenizer=str(tok_path),
        ),
        train={"batch_size": 3, "seq_len": 16, **(train or {})},
        sample={"max_new_tokens": 20, "temperature": 0.8, "top_k": 0, **(sample or {})},
    )
    torch.manual_seed(seed)
    net = Transformer(cfg.model).eval()
    if uniform:
        with torch.no_grad():
            for p in net.parameters():
                p.zero_()
    else:
        spread_weights_(net)
    run_dir = Path(cfg.train.out_dir)
    save_checkpoint(
        run_dir,
        step=10,
        model_state=net.state_dict(),
        trainer_state={"step": 10},
        state={"config": config_to_dict(cfg), "tokens_seen": 1000, "val_loss": 5.0},
        tokenizer_file=tok_path,
    )
    return run_dir, cfg, net


@torch.no_grad()
def spread_weights_(model: torch.nn.Module) -> torch.nn.Module:
    """Weights of a larger spread than any init (norms uniform in 0.5-1.5, the rest normal with
    std 0.15), in place, from torch's generator: logits far from uniform, so greedy choices are
    robust to 1e-6 differences; ours and a Hugging Face model's alike."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.uniform_(0.5, 1.5)
        else:
            p.normal_(0.0, 0.15)
    return model


def two_checkpoint_run(root: Path) -> Path:
    """make_run's run with a second checkpoint, step 20 (weights moved by 0.01; LATEST names it),
    after step 10; returns the run directory."""
    run_dir, _, net = make_run(root)
    state = json.loads((run_dir / "checkpoints" / "step_000010" / "state.json").read_text())
    with torch.no_grad():
        next(net.parameters()).add_(0.01)
    save_checkpoint(
        run_dir,
        step=20,
        model_state=net.state_dict(),
        trainer_state={"step": 20},
        state={"config": state["config"], "tokens_seen": 2000, "val_loss": 4.0},
        tokenizer_file=root / "tokenizer.json",
    )
    return run_dir


def post_training_data(root: Path) -> Path:
    """Beside a base run: preference pairs (root/pairs.jsonl, DPO), exact-match prompts
    (root/prompts.jsonl, GRPO) and a reward that varies within a group, the reply's length
    (root/rw_len.py: `python:rw_len:length`, so that advantages are not all 0); returns root."""
    words = ["abc", "hello", "moon", "star", "tree", "rock"]
    pairs = [{"prompt": f"say {w}", "chosen": w, "rejected": w[::-1]} for w in words]
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in pairs) + "\n")
    rows = [{"messages": [{"role": "user", "content": f"say {w}"}], "answer": w} for w in "abc"]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (root / "rw_len.py").write_text("def length(m, reply, answer):\n    return len(reply)\n")
    return root


def write_shards(cfg: Config, documents: list[str]) -> dict[str, Any]:
    """Tokenize `documents` into the run's data.out_dir with the real pipeline; return meta.json.

    The documents go to a .jsonl file (one document a row) at data.source; the run's tokenizer
    (data.tokenizer) is reused.
    """
    from minillm.data.meta import load_meta
    from minillm.data.tokenize_pass import write_shards as tokenize

    source = Path(cfg.data.source)
    with source.open("w", encoding="utf-8") as f:
        for doc in documents:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    tokenize(cfg)
    return load_meta(cfg.data.out_dir)


# fp32 results of one function computed two ways (another kernel's blocking, thread count or
# CPU: AMD EPYC vs Intel AMX) differ by rounding that grows with the values' size, not by an
# absolute amount. Measured on the families of tests/test_hf_families.py (logits of size 5-10):
# fp32 vs float64 1e-6 to 4e-6 of the largest logit, and F.linear's sum over K split in four
# and added in reverse order (another kernel's blocking) 8e-7 to 3.2e-6 of it; issue 62 saw
# 1.7e-5 of it between peft's unmerged logits and the merged export on an Intel AMX CPU (the
# merged weights are rounded to fp32 once more). 1e-4 leaves a margin of 6x over the worst of
# these, while a real difference (a wrong weight, position or mask) moves the values by a
# good part of their size.
FP32_REL = 1e-4


def assert_same_function(
    got: Any, want: Any, rel: float = FP32_REL, msg: str | None = None, scale: float | None = None
) -> None:
    """got and want, two computations of one function, agree within `rel` of `scale` (default:
    the larger of their largest magnitudes), compared in float64 so the check adds no rounding."""
    got64, want64 = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    if scale is None:
        scale = max(got64.abs().max().item(), want64.abs().max().item()) if got64.numel() else 0.0
    torch.testing.assert_close(got64, want64, rtol=0, atol=rel * scale, msg=msg)
