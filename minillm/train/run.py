"""A run, prepared once: everything `minillm train` needs before its first step, resolved in one
place and then fixed.

Offers `prepare_run(cfg, resume, force) -> Run`, `Run` (the final config, device, tokenizer and its
sha, the data and its packing, the starting weights, the checkpoint to resume from, the lock) and
`check_data`.

`train.init_from` is applied to the config once, where it is read
(`minillm.checkpoint.init_from.load_run_config`, what `minillm tokenize`, `train` and `info`
read); here its weights are loaded for a fresh run (and for every start of a LoRA run, whose
checkpoints hold only the adapters: its base must be the one recorded), and a config that does
not have its model or its tokenizer (one built some other way) is a ConfigError naming the key.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minillm.checkpoint import layout
from minillm.checkpoint import store as ckpt
from minillm.checkpoint.init_from import InitSource, init_source, lora_base
from minillm.checkpoint.init_from import init_weights as load_init_weights
from minillm.checkpoint.rundir import RunLock
from minillm.config import Config
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

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# ------------------------------------------------------------------ train.init_from


def _check_init_from(cfg: Config, source: InitSource) -> None:
    """A config given init_from's model and tokenizer (`load_run_config` applies them; this only
    checks, for a Config built some other way): a model or tokenizer of its own is a
    ConfigError naming the key."""
    differ = [f"model.{f.name}" for f in dataclasses.fields(source.model)
              if getattr(source.model, f.name) != getattr(cfg.model, f.name)]  # fmt: skip
    if differ:
        raise ConfigError(
            "train.init_from",
            f"the model is {source.path}'s, but the config's {', '.join(differ)} differ; read "
            "the config with minillm.checkpoint.init_from.load_run_config, which gives it that "
            "model",
        )
    own, theirs = cfg.data.tokenizer_path, source.tokenizer_file
    if own.is_file() and theirs.is_file() and tokenizer_sha256(own) != tokenizer_sha256(theirs):
        raise ConfigError(
            "data.tokenizer",
            f"{own} is another tokenizer than train.init_from's {theirs}; set data.tokenizer to "
            "it (or leave it empty) and run `minillm tokenize` again",
        )


def check_data(
    cfg: Config, meta: dict[str, Any], tokenizer_file: Path, train_tokens: int, warn_: bool = True
) -> str:
    """Check the shards (meta.json) against the tokenizer and the config; return its sha256.

    A tokenizer other than the shards', another data.text_field than theirs, a vocabulary larger
    than the model's or a train split shorter than one sequence are errors; shards made from other
    data settings a warning.
    """
    if not Path(tokenizer_file).is_file():
        raise UserError(f"{tokenizer_file}: tokenizer not found; run `minillm tokenize` first")
    sha = tokenizer_sha256(tokenizer_file)
    if meta.get("tokenizer_sha256") not in (None, sha):
        raise UserError(
            f"{cfg.data.out_dir}/meta.json: shards were made with another tokenizer than "
            f"{tokenizer_file}; run `minillm tokenize` again"
        )
    stale = stale_data_keys(meta, cfg.data)
    if "data.text_field" in stale:
        # Not a warning: the run would record a column its shards were not made from (eval and
        # chat read data.text_field from the checkpoint's config).
        made = meta["data"]["text_field"]
        raise ConfigError(
            "data.text_field",
            f"the shards were made from {made!r}, this config names {cfg.data.text_field!r}; "
            f"set data.text_field: {made} or run `minillm tokenize CONFIG` to remake them",
            str(Path(cfg.data.out_dir) / "meta.json"),
        )
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

_NO_TOKENS = np.zeros(0, dtype=np.uint16)  # the token splits of a run that reads none


def init_from_tokenizer_sha(tokenizer_file: Path) -> str:
    """The sha256 of the tokenizer of a run without shards (train.objective dpo, grpo)."""
    if not Path(tokenizer_file).is_file():
        raise ConfigError("data.tokenizer", f"{tokenizer_file}: tokenizer not found")
    return tokenizer_sha256(tokenizer_file)


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
    packing: Packing | None  # None: an objective that reads its own data (dpo, grpo)
    init_weights: dict[str, torch.Tensor] | None  # init_from's weights; None: from the seed
    init_label: str | None  # where they came from: `runs/x (step_000400)`, or the HF folder
    resume_from: Path | None  # the checkpoint to continue from; None: a fresh start
    probes: TrainingProbes | None
    lock: RunLock | None
    new_dirs: tuple[Path, ...] = ()  # folders prepare_run created, removed by a failed start
    lora_base: dict[str, str] | None = None  # train.lora: the base's identity (init_from.lora_base)
    config_dir: Path | None = None  # the config file's folder (train.grpo.reward's python: module)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The run's tokenizer, read once (LoRA's token rows, the DPO and GRPO objectives)."""
        return load_tokenizer(self.tokenizer_file)

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


def prepare_run(
    cfg: Config,
    resume: bool = True,
    force: bool = False,
    verbose: bool = True,
    config_dir: Path | None = None,
) -> Run:
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
                _check_init_from(cfg, source)
            tokenizer_file = cfg.data.tokenizer_path
            tf32 = enable_tf32(device)
            # The newest intact checkpoint, looked up (and its sha256 checked) once: both the
            # batch split of `auto` and the resume point read it.
            latest = layout.find_latest(run_dir) if resume else None
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
            if cfg.train.objective == "lm":
                meta = load_meta(cfg.data.out_dir)
                train_tokens = open_split(cfg.data.out_dir, "train")
                val_tokens = open_split(cfg.data.out_dir, "val")
                packing = Packing(cfg, meta, train_tokens, val_tokens)
                if verbose and packing.note:
                    print(packing.note)
                sha = check_data(cfg, meta, tokenizer_file, len(train_tokens), warn_=main)
            else:  # dpo, grpo: the objective reads data.source itself (minillm.train.objectives)
                meta, train_tokens, val_tokens, packing = {}, _NO_TOKENS, _NO_TOKENS, None
                sha = init_from_tokenizer_sha(tokenizer_file)
            resume_from = resume_point(
                run_dir, cfg, tokenizer_file, sha, dist.world_size, resume=resume, force=force,
                clear=main, verbose=verbose, latest=latest,
            )  # fmt: skip
            # The starting weights only for a fresh run: a resume takes its own checkpoint's, so
            # init_from's are neither read nor hashed then.
            init_weights, init_label, base = None, None, None
            # A LoRA run's checkpoints hold only the adapters: its base is loaded on a resume
            # too, and must be the one the run started from.
            # The objectives compare against init_from (their reference) on a resume too.
            keep = cfg.train.lora.rank or cfg.train.objective != "lm"
            if source is not None and (resume_from is None or keep):
                init_weights, init_label = load_init_weights(source.path)
            if cfg.train.lora.rank:
                base = _lora_base(cfg, source, init_weights, resume_from, dist)
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
        lora_base=base,
        config_dir=config_dir,
    )


def _lora_base(
    cfg: Config,
    source: InitSource,
    weights: dict[str, torch.Tensor],
    resume_from: Path | None,
    dist: DistInfo,
) -> dict[str, str]:
    """The identity of a LoRA run's base (what its checkpoints record); on a resume, a base
    whose weights are not those the run's checkpoint records is a ConfigError naming it."""
    if dist.enabled and cfg.train.parallel == "fsdp":
        raise ConfigError(
            "train.lora.rank",
            "LoRA does not run under train.parallel: fsdp (a frozen base is no memory for "
            "sharding to save); use parallel: ddp",
        )
    base = lora_base(source.path, weights)
    recorded = ckpt.lora_base_of(layout.read_state(resume_from)) if resume_from else None
    if recorded is not None and recorded["sha256"] != base["sha256"]:
        raise ConfigError(
            "train.init_from",
            f"{source.path}: its weights are not the base the LoRA run's {resume_from} was "
            f"trained on ({recorded['source']}, sha256 {recorded['sha256'][:16]}...): it has "
            "changed since",
        )
    return base
