"""The training loop: `Trainer(cfg).fit()` is what `minillm train` runs.

Offers `Trainer`, `TrainingDiverged` and `train(cfg, resume, force)`.

One optimizer step = `grad_accum` micro-batches per rank whose summed token losses are divided by
the number of target tokens of the whole global batch (with chat data, the assistant tokens only),
so the gradient equals that of one big batch of the same tokens. With `train.doc_mask` a window's
tokens attend only within their own document (minillm.data.batches.doc_ids). The batch of step s is
a pure function of (seed, s, rank, world size) and every other piece of state is in the checkpoint,
so a resumed run continues bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from minillm.checkpoint import store as ckpt
from minillm.checkpoint.rundir import RunLock, resume_point
from minillm.config import Config, config_to_dict, dump_config
from minillm.data.batches import eval_batches, train_batch
from minillm.data.meta import load_meta, open_split
from minillm.errors import UserError, warn
from minillm.infer.evaluate import evaluate_tokens, metrics
from minillm.model import Transformer, use_cpu_kernels
from minillm.model.param_groups import describe
from minillm.runtime.device import (
    StopSignal,
    autocast_context,
    enable_tf32,
    make_grad_scaler,
    resolve_device,
    resolve_precision,
    rng_state,
    seed_everything,
    set_rng_state,
)
from minillm.runtime.files import (
    atomic_copy,
    atomic_write_text,
    ensure_writable_dir,
    removing_new_dirs,
)
from minillm.runtime.perf import peak_flops
from minillm.runtime.progress import format_duration
from minillm.train.batch_size import resolve_batch_size
from minillm.train.diagnostics import activation_rms, block_snapshot, update_ratios
from minillm.train.distributed import (
    all_gather_objects,
    all_reduce_sum,
    barrier,
    init_distributed,
    local_device,
    shutdown_distributed,
)
from minillm.train.monitor import Meter, Monitor
from minillm.train.optim import build_optimizer, newton_schulz_flops, schedule_lr, set_lr
from minillm.train.packing import Packing
from minillm.train.parallel import full_state, load_full_state, no_sync, wrap_model
from minillm.train.prefetch import Prefetcher
from minillm.train.probes import TrainingProbes
from minillm.train.setup import check_data, init_from

# This rank's micro-batches (x, y) or (x, y, doc_ids) of a step, each (B, T) int64.
Batches = Callable[[int], list[tuple[torch.Tensor, ...]]]


class TrainingDiverged(UserError):
    """Too many non-finite steps in a row."""


class Trainer:
    """Owns the model, optimizer, data and run directory of one training run."""

    def __init__(
        self,
        cfg: Config,
        resume: bool = True,
        force: bool = False,
        verbose: bool = True,
        batches: Batches | None = None,
    ) -> None:
        """`batches(step)` gives this rank's micro-batches of a step; default: `train_batch` over
        the train split (a pure function of seed, step, rank and world size)."""
        self.cfg = cfg
        self.batches = batches or self._train_batches
        tc = cfg.train
        self.run_dir = Path(tc.out_dir)
        self.dist = init_distributed(resolve_device(tc.device))
        self.device = local_device(resolve_device(tc.device), self.dist)
        self.precision = resolve_precision(tc.precision, self.device)
        self.is_main = self.dist.is_main
        self.verbose = verbose and self.is_main
        # A run that fails before training (a bad config, no shards) leaves no empty run folder.
        with removing_new_dirs(*([self.run_dir] if self.is_main else [])):
            if self.is_main:
                ensure_writable_dir(self.run_dir, "train.out_dir")
            self.lock = RunLock(self.run_dir).acquire() if self.is_main else None
            try:
                self._setup(resume, force)
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ setup

    def _setup(self, resume: bool, force: bool) -> None:
        self.cfg, init_state, self.tokenizer_file = init_from(self.cfg, warn_=self.is_main)
        self.tf32 = enable_tf32(self.device)
        self.cfg = resolve_batch_size(
            self.cfg, self.device, self.precision, self.dist.world_size,
            run_dir=self.run_dir if resume else None,
            agree=lambda b: min(all_gather_objects(b)),
            log=print if self.verbose else lambda _: None,
        )  # fmt: skip
        cfg, tc = self.cfg, self.cfg.train
        self.meta = load_meta(cfg.data.out_dir)
        self.train_tokens = open_split(cfg.data.out_dir, "train")
        self.val_tokens = open_split(cfg.data.out_dir, "val")
        self.packing = Packing(cfg, self.meta, self.train_tokens, self.val_tokens)
        if self.verbose and self.packing.note:
            print(self.packing.note)
        self.tokenizer_sha = check_data(
            cfg, self.meta, self.tokenizer_file, len(self.train_tokens), warn_=self.is_main
        )

        resume_from = resume_point(
            self.run_dir,
            cfg,
            self.tokenizer_file,
            self.tokenizer_sha,
            self.dist.world_size,
            resume=resume,
            force=force,
            clear=self.is_main,
            verbose=self.verbose,
            schedule=schedule_lr,
        )
        seed_everything(tc.seed)  # the same initial weights on every rank
        self.model = use_cpu_kernels(Transformer(cfg.model))  # eager CPU training kernels
        self.model.activation_checkpointing = tc.activation_checkpointing
        if init_state is not None and resume_from is None:
            ckpt.load_weights_into(self.model, init_state, tc.init_from)
        self.model.to(self.device)
        self.train_model = wrap_model(self.model, cfg, self.device, self.precision, self.dist)
        self.optimizer = build_optimizer(self.model, tc, self.device)
        self.scaler = make_grad_scaler(self.device, self.precision)
        self.autocast = autocast_context(self.device, self.precision)
        fsdp = self.dist.enabled and tc.parallel == "fsdp"
        self.probes = TrainingProbes.create(cfg, self.tokenizer_file, self.device, self.autocast,
                                            main=self.is_main, sharded=fsdp)  # fmt: skip

        self.step = 0
        self.tokens_seen = 0
        self.best_val = math.inf
        self.bad_in_a_row = 0
        self.skipped_steps = 0
        self.last_ckpt: Path | None = None
        self.resumed = resume_from is not None
        if resume_from is not None:
            self._restore(resume_from)
        else:
            # Dropout differs per rank; the weights above did not.
            torch.manual_seed(tc.seed + self.dist.rank)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.run_dir / "config.yaml", dump_config(cfg))
            atomic_copy(self.tokenizer_file, self.run_dir / "tokenizer.json")
        self.tokens_per_step = tc.batch_size * tc.grad_accum * tc.seq_len * self.dist.world_size
        # Muon's Newton-Schulz matmuls run on every rank; MFU counts them as work done.
        ns_flops = newton_schulz_flops(self.optimizer) * self.dist.world_size
        self.flops_per_token = (
            self.model.flops_per_token(tc.seq_len) + ns_flops / self.tokens_per_step
        )

    def _restore(self, path: Path) -> None:
        state = ckpt.read_state(path)
        weights = ckpt.load_model_state(path)
        trainer_state = ckpt.load_trainer_state(path)
        load_full_state(self.model, self.optimizer, weights, trainer_state["optimizer"])
        if self.scaler is not None and trainer_state.get("scaler"):
            self.scaler.load_state_dict(trainer_state["scaler"])
        rngs = trainer_state.get("rng", [])
        if self.dist.rank < len(rngs):
            set_rng_state(rngs[self.dist.rank])
        self.step = int(trainer_state["step"])
        self.tokens_seen = int(trainer_state["tokens_seen"])
        self.best_val = float(trainer_state.get("best_val", math.inf))
        self.bad_in_a_row = int(trainer_state.get("bad_in_a_row", 0))
        self.skipped_steps = int(trainer_state.get("skipped_steps", 0))
        self.last_ckpt = path
        if self.verbose:
            saved = time.strftime("%Y-%m-%d %H:%M", time.localtime(state.get("saved_at", 0)))
            print(f"resuming from {path} (step {self.step}, saved {saved})")

    # ------------------------------------------------------------------ one step

    def micro_loss(
        self, x: torch.Tensor, y: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Summed cross-entropy of one micro-batch (a hook point for tests)."""
        with self.autocast:
            _, loss_sum = self.train_model(x, y, doc_ids=doc_ids, reduction="sum")
        return loss_sum

    def train_step(self, micro: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict:
        """Run optimizer step `self.step` on `micro` (default: `batches(self.step)`); return its
        loss and grad norm (0-d device tensors: reading them waits for the device), lr, token
        count and whether it was finite (the step's one host sync)."""
        tc = self.cfg.train
        lr = set_lr(self.optimizer, self.step, tc)
        micro = self.batches(self.step) if micro is None else micro
        # Token-weighted accumulation: divide by the target tokens of the whole global batch.
        n_tokens = all_reduce_sum(
            torch.tensor(sum(int((b[1] != -100).sum()) for b in micro), dtype=torch.float64)
        ).item()
        # DDP/FSDP average gradients over ranks; multiplying by world size undoes that.
        scale = self.dist.world_size / max(n_tokens, 1.0)
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for i, (x, y, *doc) in enumerate(micro):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            doc = [d.to(self.device, non_blocking=True) for d in doc]  # doc_ids, if packed
            sync = i == len(micro) - 1
            with no_sync(self.train_model, self.model, sync):
                loss_sum = self.micro_loss(x, y, *doc)
                loss = loss_sum * scale
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss_sum.detach().double()
        loss_mean = all_reduce_sum(total) / max(n_tokens, 1.0)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = tc.grad_clip if tc.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2 returns a DTensor
            norm = norm.full_tensor()
        # Decided on the device; bool() is the one wait for it in this step.
        ok = torch.isfinite(loss_mean)
        if self.scaler is None:  # the scaler skips inf gradients itself
            ok = ok & torch.isfinite(norm)
        finite = bool(ok)
        if finite:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Tokens processed (throughput, MFU, tokens_seen): with a target mask, more than n_tokens.
        n_inputs = sum(b[0].numel() for b in micro) * self.dist.world_size
        return {"loss": loss_mean, "grad_norm": norm.detach(), "lr": lr, "tokens": n_inputs,
                "targets": n_tokens, "finite": finite}  # fmt: skip

    def _train_batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        tc = self.cfg.train
        return train_batch(
            self.train_tokens,
            seed=tc.seed,
            step=step,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            batch_size=tc.batch_size,
            grad_accum=tc.grad_accum,
            seq_len=tc.seq_len,
            **self.packing.train_kwargs(),
        )

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float]:
        """Loss, perplexity and bits per byte over the first eval_steps validation batches,
        computed by `minillm eval`'s own evaluation (each rank takes its share)."""
        tc = self.cfg.train
        total, n = evaluate_tokens(
            self.model,
            self.val_tokens,
            tc.seq_len,
            tc.batch_size,
            self.device,
            max_batches=tc.eval_steps or None,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            autocast=self.autocast,
            batches=self.packing.val_batches(tc.seq_len, tc.batch_size, tc.eval_steps or None),
        )
        sums = all_reduce_sum(torch.tensor([total, n], dtype=torch.float64, device=self.device))
        total, n = sums[0].item(), max(int(sums[1].item()), 1)
        bytes_per_prediction = self.packing.val_bytes_per_target
        result = metrics(total, n, n * bytes_per_prediction)
        return {k: result[k] for k in ("loss", "perplexity", "bits_per_byte")}

    # ------------------------------------------------------------------ checkpoints

    def save(self, is_best: bool = False) -> Path | None:
        """Checkpoint the state after `self.step` completed steps (a collective under FSDP).

        Weights that have overflowed (a huge lr can make a step with finite gradients do that)
        are not written: the last checkpoint stays the last good one. Returns None then.
        """
        if not self._weights_finite():
            if self.is_main:
                warn(f"step {self.step}: the weights are not finite; no checkpoint written "
                     f"(the last good one: {self.last_ckpt or 'none'})")  # fmt: skip
            return None
        model_sd, optim_sd = full_state(self.model, self.optimizer)
        rngs = all_gather_objects(rng_state())  # index = rank
        if not self.is_main:
            return None
        trainer_state = {
            "optimizer": optim_sd,
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "rng": rngs,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "best_val": self.best_val,
            "bad_in_a_row": self.bad_in_a_row,
            "skipped_steps": self.skipped_steps,
        }
        state = {
            "tokens_seen": self.tokens_seen,
            "best_val_loss": self.best_val if math.isfinite(self.best_val) else None,
            "world_size": self.dist.world_size,
            "precision": self.precision,
            "tokenizer_sha256": self.tokenizer_sha,
            "config": config_to_dict(self.cfg),
        }
        self.last_ckpt = ckpt.save_checkpoint(
            self.run_dir,
            self.step,
            model_sd,
            trainer_state,
            state,
            tokenizer_file=self.tokenizer_file,
            keep_last=self.cfg.train.keep_last,
            is_best=is_best,
        )
        return self.last_ckpt

    def _weights_finite(self) -> bool:
        """Whether every weight on every rank is finite (a collective under torchrun)."""
        bad = torch.zeros((), device=self.device)
        with torch.no_grad():
            for p in self.model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 shard
                bad += (~torch.isfinite(local)).sum()
        return all_reduce_sum(bad).item() == 0

    # ------------------------------------------------------------------ the loop

    def fit(self, stop_at: int | None = None) -> dict[str, Any]:
        """Train until max_steps (or `stop_at`, or a signal); checkpoint on the way out."""
        tc = self.cfg.train
        end = min(tc.max_steps, stop_at) if stop_at is not None else tc.max_steps
        # Nothing to train: no TensorBoard writer, so no new, empty events file in tb/.
        tb_dir = self.run_dir if self.step < end else None
        monitor = Monitor(tb_dir, tc.max_steps, self.step, enabled=self.is_main)
        if self.step == 0:
            monitor.text("config", "```yaml\n" + dump_config(self.cfg) + "```")
        peak, peak_source = (
            peak_flops(self.device, self.precision, tc.peak_flops) if self.is_main else (0.0, "")
        )
        meter = Meter(self.flops_per_token, peak, self.dist.world_size)
        if self.verbose:
            monitor.print(self._banner(meter.peak, peak_source))
            if tc.warmup_steps >= tc.max_steps and self.step < tc.max_steps:
                warn(f"train.warmup_steps={tc.warmup_steps} >= train.max_steps={tc.max_steps}: "
                     "the run ends while the lr still rises, before any decay; lower "
                     f"warmup_steps (e.g. {max(tc.max_steps // 10, 1)})")  # fmt: skip
            if self.step >= tc.max_steps:
                monitor.print(
                    f"the run is already at step {self.step}, train.max_steps is "
                    f"{tc.max_steps}: nothing to train (raise max_steps to go on)"
                )
        saved_at = self.step if self.last_ckpt is not None else -1
        last_eval: dict[str, float] = {}
        shown: dict[str, str] = {}
        prefetch = Prefetcher(self.batches, end, pin=self.device.type == "cuda")
        t_start = time.perf_counter()
        notice = "stopping after this step; checkpointing it (interrupt again to stop at once)"
        stop = StopSignal(notice if self.verbose else "")
        with stop, contextlib.closing(monitor), contextlib.closing(prefetch), \
                self._say_resume_point_if_cut():  # fmt: skip
            while self.step < end and not stop.requested:
                # Every log_every*10 steps, per-layer numbers (not under FSDP: shards only).
                probe = self.is_main and (self.step + 1) % (tc.log_every * 10) == 0
                probe = probe and not (self.dist.enabled and tc.parallel == "fsdp")
                before = block_snapshot(self.model) if probe else None
                t0 = time.perf_counter()
                out = self.train_step(prefetch(self.step))
                meter.add(out["tokens"], time.perf_counter() - t0)
                self.step += 1
                self.tokens_seen += int(out["tokens"])
                self._count_bad(out)
                log = self.step % tc.log_every == 0 or self.step == end
                if log:  # loss and grad norm cross to the host on logging steps only
                    out.update(loss=float(out["loss"]), grad_norm=float(out["grad_norm"]))
                    monitor.scalars(meter.scalars(out, self.skipped_steps), self.step)
                    shown = meter.stats(out)
                if before is not None:
                    monitor.scalars(self._layer_stats(before), self.step)
                monitor.step(self.step, shown, log)
                if log:
                    meter.reset()
                is_best = False
                if (tc.eval_every and self.step % tc.eval_every == 0) or self.step == tc.max_steps:
                    last_eval = self.evaluate()
                    monitor.scalars({f"val/{k}": v for k, v in last_eval.items()}, self.step)
                    monitor.print(f"step {self.step}: val loss {last_eval['loss']:.4f}, "
                                  f"bits/byte {last_eval['bits_per_byte']:.4f}")  # fmt: skip
                    if last_eval["loss"] < self.best_val:
                        self.best_val, is_best = last_eval["loss"], True
                    if self.probes is not None:
                        self.probes.score_tasks(self.model, self.step, monitor)
                if self.probes is not None and self.probes.due(self.step):
                    self.probes.write_samples(self.model, self.step, monitor)
                if is_best or (tc.ckpt_every and self.step % tc.ckpt_every == 0):
                    with stop.finishing(f"writing the checkpoint of step {self.step}"):
                        self.save(is_best=is_best)
                    saved_at = self.step
            if saved_at != self.step:
                with stop.finishing(f"writing the checkpoint of step {self.step}"):
                    self.save()
        elapsed = time.perf_counter() - t_start
        summary = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "val": last_eval,
            "checkpoint": str(self.last_ckpt) if self.last_ckpt else None,
            "interrupted": stop.requested,
            "seconds": elapsed,
        }
        if self.verbose:
            how = f"stopped by {stop.signame}" if stop.requested else "done"
            print(f"{how} at step {self.step} after {format_duration(elapsed)}; "
                  f"checkpoint {summary['checkpoint']}")  # fmt: skip
        return summary

    @contextlib.contextmanager
    def _say_resume_point_if_cut(self) -> Iterator[None]:
        """A stop at once (a repeated Ctrl-C) says which checkpoint the next run resumes from."""
        try:
            yield
        except KeyboardInterrupt:
            if self.verbose:
                where = self.last_ckpt or "the start (no checkpoint yet)"
                warn(f"stopped at once after step {self.step}, which is not checkpointed; "
                     f"`minillm train` resumes from {where}")  # fmt: skip
            raise

    def _count_bad(self, out: dict[str, float]) -> None:
        if out["finite"]:
            self.bad_in_a_row = 0
            return
        self.bad_in_a_row += 1
        self.skipped_steps += 1
        if self.verbose:
            print(f"step {self.step}: non-finite loss or gradient, step skipped")
        if self.bad_in_a_row >= self.cfg.train.max_bad_steps:
            raise TrainingDiverged(
                f"step {self.step}: {self.bad_in_a_row} non-finite steps in a row "
                f"(train.max_bad_steps={self.cfg.train.max_bad_steps}); last good checkpoint: "
                f"{self.last_ckpt or 'none'}; try a lower train.lr or fp32"
            )

    def _layer_stats(self, before: list[torch.Tensor]) -> dict[str, float]:
        """Per-block update/weight ratio of this step and RMS of the block outputs."""
        x, _ = next(eval_batches(self.train_tokens, seq_len=self.cfg.train.seq_len, batch_size=1))
        stats = update_ratios(self.model, before)
        stats.update(activation_rms(self.model, x.to(self.device), self.autocast))
        return stats

    def _banner(self, peak: float, peak_source: str) -> str:
        tc = self.cfg.train
        n = self.model.param_count()
        return (
            f"training {n / 1e6:.2f}M parameters on {self.device} ({self.precision}"
            f"{', compiled' if tc.compile else ''}{', TF32 matmuls' if self.tf32 else ''}"
            f"{', activation checkpointing' if tc.activation_checkpointing else ''}"
            f"{f', {self.dist.world_size} ranks, {tc.parallel}' if self.dist.enabled else ''}); "
            f"global batch {tc.batch_size}x{tc.grad_accum}x{self.dist.world_size} seqs of "
            f"{tc.seq_len} = {self.tokens_per_step:,} tokens/step; "
            f"peak {peak / 1e9:.0f} GFLOP/s for MFU ({peak_source}); run dir {self.run_dir}"
            + (f"; weights from {tc.init_from}" if tc.init_from and not self.resumed else "")
            + f"\n{describe(self.model, tc)}"
        )

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        shutdown_distributed()


def train(cfg: Config, resume: bool = True, force: bool = False) -> dict[str, Any]:
    """What `minillm train` runs."""
    trainer = Trainer(cfg, resume=resume, force=force)
    try:
        result = trainer.fit()
        # Every rank leaves its last collective before any tears the group down: gloo aborts a
        # process whose peer closes the connection under it.
        barrier()
        return result
    finally:
        trainer.close()
