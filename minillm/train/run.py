"""A run, prepared once: everything `minillm train` needs before its first step, resolved in one
place and then fixed.

Offers `prepare_run(cfg, resume, force) -> Run` and `Run` (the final config, device, tokenizer
and its sha, the objective with its data read and checked, the starting weights, the checkpoint to
resume from, the lock).

`train.init_from` is applied to the config once, where it is read
(`minillm.checkpoint.init_from.load_run_config`, what `minillm tokenize`, `train` and `info`
read); here only its weights are loaded, for a fresh run (and for every start of a LoRA run, whose
checkpoints hold only the adapters: its base must be the one recorded, and of an objective whose
reference is those weights).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from minillm.checkpoint import layout
from minillm.checkpoint import store as ckpt
from minillm.checkpoint.init_from import base_digest, lora_base
from minillm.checkpoint.init_from import init_weights as load_init_weights
from minillm.checkpoint.lazy import LORA_MMAP_THRESHOLD, QLORA_MMAP_THRESHOLD, map_large_blocks
from minillm.checkpoint.rundir import RunLock
from minillm.config import Config
from minillm.errors import ConfigError, warn
from minillm.families import fused_rows, with_family
from minillm.model.nf4 import nf4_as_loaded
from minillm.runtime.device import (
    PRECISION_DTYPES,
    autocast_context,
    bf16_cpu_note,
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
from minillm.train.objectives import Objective, Setup, open_objective
from minillm.train.probes import TrainingProbes
from minillm.train.resume import resume_point

if TYPE_CHECKING:
    from tokenizers import Tokenizer


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
    tokenizer: Tokenizer
    objective: Objective  # train.objective, its data read and checked
    # init_from's model (built lazily: float32, or a LoRA run's frozen base in the compute
    # dtype, `base_dtype`); None: from the seed
    init_weights: torch.nn.Module | None
    init_label: str | None  # where they came from: `runs/x (step_000400)`, or the HF folder
    resume_from: Path | None  # the checkpoint to continue from; None: a fresh start
    probes: TrainingProbes | None
    lock: RunLock | None
    new_dirs: tuple[Path, ...] = ()  # folders prepare_run created, removed by a failed start
    lora_base: dict[str, str] | None = None  # train.lora: the base's identity (init_from.lora_base)

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
    (once); batch_size: auto and its split; the tokenizer; the objective, its data read and
    checked (the shards, pairs or prompts); the checkpoint to resume from (one integrity check);
    the probes' task files.

    A run that fails here (a bad config, no shards, a bad pairs file) leaves no lock and no empty
    run folder, and has cleared nothing (`--force` clears only after the data is read).
    """
    # model.family: the one its config load resolved, or (a Config built in Python) resolved now,
    # so config.yaml and every checkpoint carry it.
    cfg = dataclasses.replace(cfg, model=with_family(cfg.model))
    tc = cfg.train
    run_dir = Path(tc.out_dir)
    dist = init_distributed(resolve_device(tc.device))
    device = local_device(resolve_device(tc.device), dist)
    precision = resolve_precision(tc.precision, device)
    main = dist.is_main
    verbose = verbose and main
    note = bf16_cpu_note(device, precision) if verbose else None
    if note:
        warn(note)
    new_dirs = _new_dirs(run_dir) if main else ()
    lock = None
    with removing_new_dirs(*([run_dir] if main else [])):
        try:
            if main:
                ensure_writable_dir(run_dir, "train.out_dir")
            lock = RunLock(run_dir).acquire() if main else None
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
            # Before resume_point, which may clear a run (--force): bad data stops it first.
            setup = Setup(cfg, dist, device, verbose, config_dir)
            objective = open_objective(setup)  # its data read and checked (lm: the shards)
            tokenizer_file, sha = setup.tokenizer_file, setup.tokenizer_sha
            resume_from = resume_point(
                run_dir, cfg, tokenizer_file, sha, dist.world_size, resume=resume, force=force,
                clear=main, verbose=verbose, latest=latest,
            )  # fmt: skip
            # The starting weights only for a fresh run: a resume takes its own checkpoint's, so
            # init_from's are neither read nor hashed then.
            init_weights, init_label, base = None, None, None
            # A LoRA run's checkpoints hold only the adapters: its base is loaded on a resume
            # too, and must be the one the run started from.
            # An objective with a reference compares against init_from on a resume too.
            keep = cfg.train.lora.rank or objective.needs_start_weights
            dtype = base_dtype(cfg, precision, resume_from)
            # QLoRA: each linear layer of the blocks becomes NF4 as soon as it is read, so the
            # base is never held whole in `dtype`.
            qlora = bool(cfg.train.lora.rank) and cfg.train.lora.quantize == "nf4"
            on_filled = nf4_as_loaded(fused_rows(cfg.model)) if qlora else None
            # Freed blocks go back to the system (lazy's why): QLoRA, and bf16 LoRA, whose peak
            # glibc's rising threshold left to chance (fp32 LoRA's did not vary).
            if qlora or (cfg.train.lora.rank and dtype == torch.bfloat16):
                map_large_blocks(QLORA_MMAP_THRESHOLD if qlora else LORA_MMAP_THRESHOLD)
            # A LoRA base's sha256 is computed as its weights are read, not read again.
            digest = base_digest(cfg.model, dtype) if cfg.train.lora.rank else None
            if tc.init_from and (resume_from is None or keep):
                init_weights, init_label = load_init_weights(
                    tc.init_from, cfg.model, dtype, on_filled, digest
                )
            if cfg.train.lora.rank:
                weights = None if qlora else init_weights.state_dict()
                digested = digest.hexdigest() if digest is not None else None
                base = _lora_base(cfg, weights, resume_from, dist, dtype, digested)
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
        tokenizer_file=tokenizer_file,
        tokenizer_sha=sha,
        tokenizer=setup.tokenizer,
        objective=objective,
        init_weights=init_weights,
        init_label=init_label,
        resume_from=resume_from,
        probes=probes,
        lock=lock,
        new_dirs=new_dirs,
        lora_base=base,
    )


def base_dtype(cfg: Config, precision: str, resume_from: Path | None) -> torch.dtype:
    """The dtype init_from's weights load in: a LoRA run's frozen base in the compute dtype of
    train.precision (bf16, fp16: its adapters stay float32), as its checkpoints record it on a
    resume; float32 otherwise (the trained weights are the optimizer's float32 masters)."""
    if not cfg.train.lora.rank:
        return torch.float32
    if resume_from is not None:
        recorded = ckpt.lora_base_of(layout.read_state(resume_from)) or {}
        return getattr(torch, str(recorded.get("dtype", "float32")), torch.float32)
    return PRECISION_DTYPES.get(precision, torch.float32)


def _lora_base(
    cfg: Config,
    weights: dict[str, torch.Tensor] | None,
    resume_from: Path | None,
    dist: DistInfo,
    dtype: torch.dtype,
    sha256: str | None = None,
) -> dict[str, str]:
    """The identity of a LoRA run's base (what its checkpoints record; `sha256` its digest where
    the load computed it); on a resume, a base whose weights are not those the run's checkpoint
    records is a ConfigError naming it."""
    if dist.enabled and cfg.train.parallel == "fsdp":
        raise ConfigError(
            "train.lora.rank",
            "LoRA does not run under train.parallel: fsdp (a frozen base is no memory for "
            "sharding to save); use parallel: ddp",
        )
    base = lora_base(cfg.train.init_from, weights, dtype, cfg.model, sha256)
    recorded = ckpt.lora_base_of(layout.read_state(resume_from)) if resume_from else None
    if recorded is not None and recorded["sha256"] != base["sha256"]:
        raise ConfigError(
            "train.init_from",
            f"{cfg.train.init_from}: its weights are not the base the LoRA run's {resume_from} "
            f"was trained on ({recorded['source']}, sha256 {recorded['sha256'][:16]}...): it has "
            "changed since",
        )
    return base
