"""Small runs for trainer tests: a slice of Shakespeare, a 300-token BPE, a tiny model."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minillm.config import Config, config_from_dict

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT / "data" / "tinyshakespeare.txt"


def tiny_config(tmp_path: Path, **sections: dict[str, Any]) -> Config:
    """A config whose data and run live under tmp_path; `sections` override keys per section."""
    raw: dict[str, dict[str, Any]] = {
        "model": dict(d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=64, max_seq_len=64),
        "data": dict(
            source=str(tmp_path / "corpus.txt"),
            vocab_size=300,
            out_dir=str(tmp_path / "tokens"),
        ),
        "train": dict(
            out_dir=str(tmp_path / "run"),
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
        ),
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


def prepared_config(tmp_path: Path, **sections: dict[str, Any]) -> Config:
    """tiny_config with its corpus written and tokenized."""
    from minillm.data.tokenize_pass import write_shards

    text = SHAKESPEARE.read_text(encoding="utf-8")[:60_000]
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    cfg = tiny_config(tmp_path, **sections)
    write_shards(cfg)
    return cfg


def run_config(data_dir: Path, run: Path, model: dict | None = None, **train: Any) -> Config:
    """tiny_config over the corpus tokenized in data_dir, training into `run`."""
    return tiny_config(data_dir, model=model or {}, train=dict(out_dir=str(run), **train))


def trained_run(base: Path) -> Path:
    """A tokenized corpus under `base`, a 4-step run with checkpoints at steps 2 and 4 (BEST names
    one of them) and its config as `base/cfg.yaml`; returns `base`."""
    import yaml

    from minillm.config import config_to_dict

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


def make_trainer(
    cfg: Config,
    resume: bool = True,
    force: bool = False,
    verbose: bool = True,
    batches: Callable[[int], list] | None = None,
) -> Any:
    """`Trainer(prepare_run(cfg, ...))`, as `minillm train` builds it; `batches(step)` replaces
    the train split's micro-batches (the trainer's `batches` method) for a test that feeds its
    own."""
    from minillm.train.run import prepare_run
    from minillm.train.trainer import Trainer

    trainer = Trainer(prepare_run(cfg, resume=resume, force=force, verbose=verbose))
    if batches is not None:
        trainer.batches = batches
    return trainer


def weights(trainer: Any) -> dict[str, Any]:
    """A copy of the trainer's model weights."""
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def error_line(result) -> str:  # noqa: ANN001
    """The one `error:` line of a failed command (exit 2, nothing else on stderr)."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]
