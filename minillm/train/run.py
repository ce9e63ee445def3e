"""A run, prepared once: everything `minillm train` needs before its first step, resolved in one
place and then fixed.

Offers `prepare_run(cfg, resume, force) -> Run`, `Run` (the final config, device, tokenizer and its
sha, the data and its packing, the starting weights, the checkpoint to resume from, the lock),
`load_train_config(path, overrides)` (what `minillm train`, `tokenize` and `info` read),
`InitSource` / `init_source(path)` (what `train.init_from` names) and `check_data`.

`train.init_from` is resolved here and not in `minillm.config` (a leaf of the layers). It names a
Hugging Face Llama folder, or a minillm run directory (its newest intact checkpoint) or one
checkpoint: the model and the tokenizer are then the run's (or the folder's). An empty
`data.tokenizer` becomes that tokenizer (and an absent `data.vocab_size` its size), so `minillm
tokenize` makes the fine-tuning shards with the vocabulary the model was trained on (every tokenizer
minillm trains reserves the chat tokens). A bad `train.init_from` is a ConfigError naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minillm.checkpoint import store as ckpt
from minillm.checkpoint.hf_folder import hf_model_config, import_hf_folder
from minillm.checkpoint.rundir import RunLock
from minillm.config import (
    Config,
    ModelConfig,
    config_from_dict,
    config_to_dict,
    override_keys,
    read_raw_config,
)
from minillm.data.meta import load_meta, open_split, stale_data_keys
from minillm.data.tokenizer import load_tokenizer, tokenizer_sha256
from minillm.errors import ConfigError, UserError, warn
from minillm.runtime.device import (
    autocast_context,
    enable_tf32,
    resolve_device,
    resolve_precision,
)
from minillm.runtime.files import ensure_writable_dir, removing_new_dirs
from minillm.train.batch_size import batch_split_of, resolve_batch_size
from minillm.train.distributed import (
    DistInfo,
    all_gather_objects,
    init_distributed,
    local_device,
    shutdown_distributed,
)
from minillm.train.packing import Packing
from minillm.train.probes import TrainingProbes
from minillm.train.resume import resume_point

# ------------------------------------------------------------------ train.init_from


@dataclass(frozen=True)
class InitSource:
    """What `train.init_from` names: its model config and tokenizer (read without the weights),
    and where its weights are (`load_weights`)."""

    path: str
    model: ModelConfig
    tokenizer_file: Path
    vocab_size: int  # the size of that tokenizer (a run's data.vocab_size)
    minillm: bool

    def load_weights(self) -> tuple[dict[str, torch.Tensor], str]:
        """The float32 state_dict (a checkpoint's is integrity-checked first) and where it came
        from, for the banner: `runs/x (step_000400)` for a run directory (its newest intact
        checkpoint), else the checkpoint or Hugging Face folder as given."""
        if not self.minillm:
            return import_hf_folder(self.path)[1], self.path
        found = ckpt.resolve_checkpoint(self.path)
        given_one = (Path(self.path) / ckpt.STATE_FILE).is_file()
        label = self.path if given_one else f"{self.path} ({found.name})"
        return ckpt.load_model_state(found), label


def _is_minillm(path: str | Path) -> bool:
    """Whether train.init_from names a minillm run or checkpoint (else an HF folder)."""
    p = Path(path)
    return (p / ckpt.CKPT_DIR).is_dir() or (p / ckpt.STATE_FILE).is_file()


def init_source(path: str, file: str | None = None) -> InitSource:
    """The model config and tokenizer of a minillm run's newest checkpoint (or of one
    checkpoint), or of a Hugging Face Llama folder.

    What is wrong with it (no such folder, no checkpoint yet, not a model folder, no tokenizer)
    is a ConfigError `<file>: train.init_from: <what>`.
    """
    try:
        return _init_source(path)
    except UserError as e:
        raise ConfigError("train.init_from", str(e), file) from None


def _init_source(path: str) -> InitSource:
    if not _is_minillm(path):
        model = hf_model_config(path)
        tok = Path(path) / ckpt.TOKENIZER_FILE
        if not tok.is_file():
            raise UserError(
                f"{path}: no {ckpt.TOKENIZER_FILE} (minillm needs the fast tokenizer file of "
                "the model)"
            )
        return InitSource(path, model, tok, load_tokenizer(tok).get_vocab_size(), False)
    found = ckpt.resolve_checkpoint(path, verify=False)  # the config only; load_weights verifies
    cfg = config_from_dict(ckpt.read_state(found)["config"], file=str(found / ckpt.STATE_FILE))
    # A run directory's own copy (stable while its checkpoints get pruned), else the checkpoint's.
    tok = found.parent.parent / ckpt.TOKENIZER_FILE
    for candidate in (Path(path) / ckpt.TOKENIZER_FILE, found / ckpt.TOKENIZER_FILE):
        if candidate.is_file():
            tok = candidate
            break
    return InitSource(path, cfg.model, tok, cfg.data.vocab_size, True)


def load_train_config(
    path: str | Path, overrides: list[str] | None = None, require_model: bool = True
) -> Config:
    """`load_config`, except that a config without a model section takes train.init_from's
    (and an empty data.tokenizer init_from's tokenizer): `minillm tokenize` and `info` see the
    model the run will train. The run itself applies init_from in `prepare_run`.

    `require_model=False` (`minillm tokenize`, which reads only the data section) accepts a
    config with neither a model section nor init_from.
    """
    raw = read_raw_config(path, overrides)
    overridden = override_keys(overrides or [])
    train = raw.get("train")
    init_from = train.get("init_from") if isinstance(train, dict) else None
    if init_from:
        where = "--set" if "train.init_from" in overridden else str(path)
        source = init_source(str(init_from), file=where)
        if "model" not in raw:
            raw["model"] = dataclasses.asdict(source.model)
        data = raw.setdefault("data", {})
        if isinstance(data, dict) and not data.get("tokenizer"):
            data["tokenizer"] = str(source.tokenizer_file)
            data.setdefault("vocab_size", source.vocab_size)  # the size of that tokenizer
    return config_from_dict(raw, str(path), overridden, require_model=require_model)


def _with_init_model(cfg: Config, source: InitSource, warn_: bool) -> Config:
    """`cfg` with init_from's model; config model keys that differ are named in a warning."""
    differ = [f"model.{f.name}" for f in dataclasses.fields(source.model)
              if getattr(source.model, f.name) != getattr(cfg.model, f.name)]  # fmt: skip
    if differ and warn_:
        warn(f"train.init_from: the model is {source.path}'s; the config's "
             f"{', '.join(differ)} are not used")  # fmt: skip
    # Validated again as a whole: the other sections' checks against the new model.
    return config_from_dict(
        config_to_dict(dataclasses.replace(cfg, model=source.model)), file="train.init_from"
    )


def check_data(
    cfg: Config, meta: dict[str, Any], tokenizer_file: Path, train_tokens: int, warn_: bool = True
) -> str:
    """Check the shards (meta.json) against the tokenizer and the config; return its sha256.

    A tokenizer other than the shards', a vocabulary larger than the model's or a train split
    shorter than one sequence are errors; shards made from other data settings a warning.
    """
    if not Path(tokenizer_file).is_file():
        raise UserError(f"{tokenizer_file}: tokenizer not found; run `minillm tokenize` first")
    sha = tokenizer_sha256(tokenizer_file)
    if meta.get("tokenizer_sha256") not in (None, sha) and cfg.train.init_from:
        raise ConfigError(
            "data.tokenizer",
            f"the shards in {cfg.data.out_dir} were made with another tokenizer than "
            f"train.init_from's {tokenizer_file}; set data.tokenizer to it (or leave it empty) "
            "and run `minillm tokenize` again",
        )
    if meta.get("tokenizer_sha256") not in (None, sha):
        raise UserError(
            f"{cfg.data.out_dir}/meta.json: shards were made with another tokenizer than "
            f"{tokenizer_file}; run `minillm tokenize` again"
        )
    stale = stale_data_keys(meta, cfg.data)
    if stale and warn_:
        warn(f"{cfg.data.out_dir}/meta.json: the shards were made with other "
             f"{', '.join(stale)} than this config's; run `minillm tokenize CONFIG` to "
             "remake them")  # fmt: skip
    vocab = int(meta["vocab_size"])
    if vocab > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{cfg.model.vocab_size} is smaller than the tokenizer's {vocab} tokens",
        )
    if train_tokens < cfg.train.seq_len + 1:
        raise ConfigError(
            "train.seq_len", f"the train split has {train_tokens} tokens, fewer than seq_len+1"
        )
    return sha


# ------------------------------------------------------------------ the run


@dataclass(frozen=True)
class Run:
    """Everything a training run needs, resolved once by `prepare_run`; the Trainer builds the
    model and optimizer from it. Holds the run lock (rank 0) until `close()`."""

    cfg: Config  # final: init_from's model, integer batch_size and grad_accum
    run_dir: Path
    dist: DistInfo
    device: torch.device
    precision: str
    tf32: bool  # TF32 matmuls were switched on
    verbose: bool  # rank 0 and asked to talk
    tokenizer_file: Path
    tokenizer_sha: str
    meta: dict[str, Any]  # the shards' meta.json
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    packing: Packing
    init_weights: dict[str, torch.Tensor] | None  # init_from's weights; None: from the seed
    init_label: str | None  # where they came from: `runs/x (step_000400)`, or the HF folder
    resume_from: Path | None  # the checkpoint to continue from; None: a fresh start
    probes: TrainingProbes | None
    lock: RunLock | None
    new_dirs: tuple[Path, ...] = ()  # folders prepare_run created, removed by a failed start

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    def close(self, failed: bool = False) -> None:
        """Release the lock and leave the process group; `failed` (before the first checkpoint
        or config.yaml was written) also removes the folders this run created, if empty."""
        if self.lock is not None:
            self.lock.release()
        shutdown_distributed()
        if failed:
            for p in sorted(self.new_dirs, key=lambda p: len(p.parts), reverse=True):
                try:
                    p.rmdir()  # only if empty
                except OSError:
                    pass


def _new_dirs(folder: Path) -> tuple[Path, ...]:
    """`folder` and those of its parents that do not exist yet."""
    new = []
    for p in (folder, *folder.parents):
        if p.exists():
            break
        new.append(p)
    return tuple(new)


def prepare_run(cfg: Config, resume: bool = True, force: bool = False, verbose: bool = True) -> Run:
    """Resolve a run from its config: device, precision and process group; the lock; init_from
    (once); batch_size: auto and its split; the shards, their packing and the tokenizer check;
    the checkpoint to resume from (one integrity check); the probes' task files.

    A run that fails here (a bad config, no shards) leaves no lock and no empty run folder.
    """
    tc = cfg.train
    run_dir = Path(tc.out_dir)
    dist = init_distributed(resolve_device(tc.device))
    device = local_device(resolve_device(tc.device), dist)
    precision = resolve_precision(tc.precision, device)
    main = dist.is_main
    verbose = verbose and main
    new_dirs = _new_dirs(run_dir) if main else ()
    lock = None
    with removing_new_dirs(*([run_dir] if main else [])):
        try:
            if main:
                ensure_writable_dir(run_dir, "train.out_dir")
            lock = RunLock(run_dir).acquire() if main else None
            source = init_source(tc.init_from) if tc.init_from else None
            if source is not None:
                cfg = _with_init_model(cfg, source, warn_=main)
            tokenizer_file = source.tokenizer_file if source else cfg.data.tokenizer_path
            tf32 = enable_tf32(device)
            # The newest intact checkpoint, looked up (and its sha256 checked) once: both the
            # batch split of `auto` and the resume point read it.
            latest = ckpt.find_latest(run_dir) if resume else None
            batch_size, grad_accum = resolve_batch_size(
                cfg, device, precision, dist.world_size,
                previous=batch_split_of(latest) if latest is not None else None,
                agree=lambda b: min(all_gather_objects(b)),
                log=print if verbose else lambda _: None,
            )  # fmt: skip
            cfg = dataclasses.replace(
                cfg,
                train=dataclasses.replace(
                    cfg.train, batch_size=batch_size, grad_accum=grad_accum
                ),  # fmt: skip
            )
            meta = load_meta(cfg.data.out_dir)
            train_tokens = open_split(cfg.data.out_dir, "train")
            val_tokens = open_split(cfg.data.out_dir, "val")
            packing = Packing(cfg, meta, train_tokens, val_tokens)
            if verbose and packing.note:
                print(packing.note)
            sha = check_data(cfg, meta, tokenizer_file, len(train_tokens), warn_=main)
            resume_from = resume_point(
                run_dir, cfg, tokenizer_file, sha, dist.world_size, resume=resume, force=force,
                clear=main, verbose=verbose, latest=latest,
            )  # fmt: skip
            # The starting weights only for a fresh run: a resume takes its own checkpoint's, so
            # init_from's are neither read nor hashed then.
            init_weights, init_label = None, None
            if source is not None and resume_from is None:
                init_weights, init_label = source.load_weights()
            fsdp = dist.enabled and cfg.train.parallel == "fsdp"
            probes = TrainingProbes.create(
                cfg, tokenizer_file, device, autocast_context(device, precision),
                main=main, sharded=fsdp,
            )  # fmt: skip
        except BaseException:
            if lock is not None:
                lock.release()
            shutdown_distributed()
            raise
    return Run(
        cfg=cfg,
        run_dir=run_dir,
        dist=dist,
        device=device,
        precision=precision,
        tf32=tf32,
        verbose=verbose,
        tokenizer_file=Path(tokenizer_file),
        tokenizer_sha=sha,
        meta=meta,
        train_tokens=train_tokens,
        val_tokens=val_tokens,
        packing=packing,
        init_weights=init_weights,
        init_label=init_label,
        resume_from=resume_from,
        probes=probes,
        lock=lock,
        new_dirs=new_dirs,
    )
