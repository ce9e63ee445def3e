"""The training loop: `train(cfg, resume, force)` is what `minillm train` runs.

Offers `Trainer`, `StepResult`, `TrainingDiverged` and `train`. `prepare_run` (train/run.py)
resolves the run once; `Trainer(run)` builds the model and optimizer from it and `fit()` runs the
loop, which reads top to bottom: train a step, log, evaluate, probe, checkpoint.

One optimizer step = `grad_accum` micro-batches per rank whose summed token losses are divided by
the number of target tokens of the whole global batch (with chat data, the assistant tokens only),
so the gradient equals that of one big batch of the same tokens. With `train.doc_mask` a window's
tokens attend only within their own document (minillm.data.batches.doc_ids). The batch of step s is
a pure function of (seed, s, rank, world size) and every other piece of state is in the checkpoint,
so a resumed run continues bit for bit.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from minillm.checkpoint.weights import load_weights_into
from minillm.config import Config, dump_config
from minillm.data.batches import MicroBatch, eval_batches, train_batch
from minillm.errors import UserError, warn
from minillm.infer.evaluate import evaluate_tokens, metrics
from minillm.model import Transformer, use_cpu_kernels
from minillm.model.lora import add_lora, token_ids_of, warn_unseen_chat_tokens
from minillm.model.moe import router_stats
from minillm.runtime.device import StopSignal, autocast_context, make_grad_scaler, seed_everything
from minillm.runtime.files import atomic_copy, atomic_write_text
from minillm.runtime.progress import format_duration
from minillm.train.diagnostics import activation_rms, block_snapshot, update_ratios
from minillm.train.distributed import all_reduce_sum, barrier
from minillm.train.ema import WeightEMA
from minillm.train.monitor import ExpertLoad, Meter, Monitor, open_monitor
from minillm.train.objectives import Objective, StepResult
from minillm.train.optim import build_optimizer, newton_schulz_flops, set_lr
from minillm.train.parallel import no_sync, release_groups, wrap_model
from minillm.train.prefetch import Prefetcher
from minillm.train.run import Run, prepare_run
from minillm.train.state import TrainState, restore_checkpoint, save_checkpoint


class TrainingDiverged(UserError):
    """Too many non-finite steps in a row."""


def make_objective(run: Run, model: Transformer) -> Objective | None:
    """The objective of `train.objective` over `model` (holding init_from's weights, before a
    resume loads its own), its data read and checked; None for `lm`, this module's own loss."""
    if run.cfg.train.objective == "dpo":
        from minillm.train.dpo import DPO

        return DPO(run, model)
    if run.cfg.train.objective == "grpo":
        from minillm.train.grpo import GRPO

        return GRPO(run, model)
    return None


class Trainer:
    """Builds the model, optimizer and grad scaler of a prepared `Run` and trains it:
    `Trainer(prepare_run(cfg, ...))`, as `train()` does. `state` (a TrainState: those and the
    loop's counters) is what its checkpoints save and a resume restores."""

    def __init__(self, run: Run) -> None:
        try:
            self._build(run)
        except BaseException:
            run.close(failed=True)
            self._let_go_of_the_group()
            gc.collect()  # while Python is whole: see train()
            raise

    def _build(self, run: Run) -> None:
        self.run, self.cfg = run, run.cfg
        self.run_dir, self.dist, self.device = run.run_dir, run.dist, run.device
        self.precision, self.is_main, self.verbose = run.precision, run.is_main, run.verbose
        self.tf32, self.init_label = run.tf32, run.init_label
        self.probes, self.packing = run.probes, run.packing
        tc = self.cfg.train
        seed_everything(tc.seed)  # the same initial weights on every rank
        self.model = use_cpu_kernels(Transformer(self.cfg.model))  # eager CPU training kernels
        self.model.activation_checkpointing = tc.activation_checkpointing
        if run.init_weights is not None:
            load_weights_into(self.model, run.init_weights, tc.init_from)
        elif tc.zero_init_residual:  # a resume loads its own weights below
            with torch.no_grad():
                for w in self.model.residual_projections():
                    w.zero_()
        if tc.lora.rank:  # the base frozen, adapters on its linear layers: only they train
            add_lora(self.model, tc.lora, token_ids_of(tc.lora, run.tokenizer, run.tokenizer_file))
            chat = run.meta.get("chat") and run.verbose
            warn_unseen_chat_tokens(self.model, tc.lora, run.tokenizer, chat)
        self.model.to(self.device)
        # train.objective dpo | grpo: its data, reference (init_from's weights, before a resume
        # loads the run's) and step; None for lm, the next-token loss below.
        self.objective = make_objective(run, self.model)
        self.train_model = wrap_model(self.model, self.cfg, self.device, self.precision, self.dist)
        # After the wrapping: under FSDP2 the average is of this rank's shards.
        self.ema = WeightEMA(self.model, tc.ema_decay) if tc.ema_decay > 0 else None
        self.optimizer = build_optimizer(self.model, tc, self.device)
        self.scaler = make_grad_scaler(self.device, self.precision)
        self.autocast = autocast_context(self.device, self.precision)

        # A mixture of experts: its routing (logged) and its load-balancing loss (moe_aux_loss).
        n_experts = self.cfg.model.n_experts
        self.expert_load = ExpertLoad(n_experts) if n_experts else None
        self.state = TrainState(self.model, self.optimizer, self.scaler, self.ema)
        self.last_eval: dict[str, float] = {}
        if run.resume_from is not None:
            restore_checkpoint(run, self.state, run.resume_from)
        else:
            # Dropout differs per rank; the weights above did not.
            torch.manual_seed(tc.seed + self.dist.rank)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.run_dir / "config.yaml", dump_config(self.cfg))
            atomic_copy(run.tokenizer_file, self.run_dir / "tokenizer.json")
        self.tokens_per_step = tc.batch_size * tc.grad_accum * tc.seq_len * self.dist.world_size
        # Muon's Newton-Schulz matmuls run on every rank; MFU counts them as work done.
        ns_flops = newton_schulz_flops(self.optimizer) * self.dist.world_size
        self.flops_per_token = (
            self.model.flops_per_token(tc.seq_len) + ns_flops / self.tokens_per_step
        )

    # ------------------------------------------------------------------ one step

    def train_step(self, micro: list[MicroBatch] | None = None) -> StepResult:
        """Run optimizer step `state.step` on `micro` (default: `batches(state.step)`). Deciding
        whether it was finite is the step's one host sync."""
        tc = self.cfg.train
        micro = self.batches(self.state.step) if micro is None else micro
        if self.objective is not None:
            return self.objective.train_step(self, micro)
        lr = set_lr(self.optimizer, self.state.step, tc)
        # Token-weighted accumulation: divide by the target tokens of the whole global batch.
        n_tokens = all_reduce_sum(
            torch.tensor(sum(int((m.targets != -100).sum()) for m in micro), dtype=torch.float64)
        ).item()
        # DDP/FSDP average gradients over ranks; multiplying by world size undoes that.
        scale = self.dist.world_size / max(n_tokens, 1.0)
        inputs = sum(m.tokens.numel() for m in micro)  # this rank's
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for i, m in enumerate(micro):
            m = m.to(self.device, non_blocking=True)  # asynchronous from pinned memory (CUDA)
            with no_sync(self.train_model, self.model, sync=i == len(micro) - 1):
                with self.autocast:
                    _, loss_sum = self.train_model(
                        m.tokens, m.targets, doc_ids=m.doc_ids, reduction="sum"
                    )
                loss = loss_sum * scale
                if self.expert_load is not None:
                    # The load-balancing loss of each micro-batch, weighted by its share of the
                    # inputs: the step's loss gets their mean (DDP then averages over ranks).
                    aux = self.expert_load.add(router_stats(self.model))
                    if tc.moe_aux_loss:
                        loss = loss + tc.moe_aux_loss * m.tokens.numel() / inputs * aux
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss_sum.detach().double()
        loss_mean = all_reduce_sum(total) / max(n_tokens, 1.0)
        norm, finite = self._clip_and_step(loss_mean)
        # Tokens processed (throughput, MFU, tokens_seen): with a target mask, more than n_tokens.
        n_inputs = sum(m.tokens.numel() for m in micro) * self.dist.world_size
        return StepResult(loss_mean, norm, lr, n_inputs, n_tokens, finite)

    def _clip_and_step(self, loss_mean: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Unscale (fp16), clip, and step unless the loss or gradient is not finite; return the
        gradient norm and whether the step was taken (the scaler skips inf gradients itself)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2 returns a DTensor
            norm = norm.full_tensor()
        # Decided on the device; bool() is the one wait for it in this step.
        ok = torch.isfinite(loss_mean)
        if self.scaler is None:
            ok = ok & torch.isfinite(norm)
        finite = bool(ok)
        if finite:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            if self.ema is not None:  # a skipped step moves neither the weights nor the average
                self.ema.update()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.detach(), finite

    def batches(self, step: int) -> list[MicroBatch]:
        """This rank's micro-batches of optimizer step `step`: a pure function of seed, step,
        rank and world size over the train split (what a resume relies on); an objective's
        own (pairs, prompts)."""
        if self.objective is not None:
            return self.objective.batches(step)
        tc = self.cfg.train
        return train_batch(
            self.run.train_tokens,
            seed=tc.seed,
            step=step,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            batch_size=tc.batch_size,
            grad_accum=tc.grad_accum,
            seq_len=tc.seq_len,
            **self.packing.train_kwargs(),
        )

    def count_step(self, result: StepResult) -> None:
        """Advance the counters past a finished step; too many non-finite steps in a row stop
        the run (TrainingDiverged)."""
        self.state.step += 1
        self.state.tokens_seen += int(result.tokens)
        if result.finite:
            self.state.bad_in_a_row = 0
            return
        self.state.bad_in_a_row += 1
        self.state.skipped_steps += 1
        if self.verbose:
            print(f"step {self.state.step}: non-finite loss or gradient, step skipped")
        if self.state.bad_in_a_row >= self.cfg.train.max_bad_steps:
            raise TrainingDiverged(
                f"step {self.state.step}: {self.state.bad_in_a_row} non-finite steps in a row "
                f"(train.max_bad_steps={self.cfg.train.max_bad_steps}); last good checkpoint: "
                f"{self.state.last_ckpt or 'none'}; try a lower train.lr or fp32"
            )

    # ------------------------------------------------------------------ evaluation, checkpoints

    def averaged(self) -> contextlib.AbstractContextManager:
        """Inside, the model holds the weights a checkpoint saves: the average under
        train.ema_decay, else its own."""
        return self.ema.swapped() if self.ema is not None else contextlib.nullcontext()

    def evaluate(self) -> dict[str, float]:
        """Loss, perplexity and bits per byte of the weights a checkpoint saves, over the first
        eval_steps validation batches, computed by `minillm eval`'s own evaluation (each rank
        takes its share)."""
        with self.averaged():
            return self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        tc, packing = self.cfg.train, self.packing
        total, n = evaluate_tokens(
            self.model,
            self.run.val_tokens,
            tc.seq_len,
            tc.batch_size,
            self.device,
            max_batches=tc.eval_steps or None,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            autocast=self.autocast,
            batches=packing.val_batches(tc.seq_len, tc.batch_size, tc.eval_steps or None),
        )
        sums = all_reduce_sum(torch.tensor([total, n], dtype=torch.float64, device=self.device))
        total, n = sums[0].item(), max(int(sums[1].item()), 1)
        result = metrics(total, n, n * packing.val_bytes_per_target)
        return {k: result[k] for k in ("loss", "perplexity", "bits_per_byte")}

    def save(self, is_best: bool = False) -> Path | None:
        """Checkpoint the state after `state.step` completed steps (a collective under FSDP);
        the checkpoint's path, or None (other ranks, or weights not finite: nothing written)."""
        return save_checkpoint(self.run, self.state, is_best)

    # ------------------------------------------------------------------ the loop

    def fit(self, stop_at: int | None = None) -> dict[str, Any]:
        """Train until max_steps (or `stop_at`, or a signal); checkpoint on the way out."""
        tc = self.cfg.train
        end = min(tc.max_steps, stop_at) if stop_at is not None else tc.max_steps
        monitor, meter = open_monitor(self, end)
        saved_at = self.state.step if self.state.last_ckpt is not None else -1
        pin = self.device.type == "cuda" and self.objective is None  # tensors to pin: lm's
        prefetch = Prefetcher(self.batches, end, pin=pin)
        notice = "stopping after this step; checkpointing it (interrupt again to stop at once)"
        stop = StopSignal(notice if self.verbose else "")
        shown: dict[str, str] = {}
        t_start = time.perf_counter()
        with stop, contextlib.closing(monitor), contextlib.closing(prefetch), \
                self._say_resume_point_if_cut():  # fmt: skip
            while self.state.step < end and not stop.requested:
                before = self._snapshot_if_probing()
                t0 = time.perf_counter()
                result = self.train_step(prefetch(self.state.step))
                meter.add(result.tokens, time.perf_counter() - t0)
                self.count_step(result)
                shown = self._log(result, meter, monitor, end, shown)
                self._log_layers(before, monitor)
                is_best = self._evaluate_if_due(monitor)
                self._probe(monitor)
                if is_best or (tc.ckpt_every and self.state.step % tc.ckpt_every == 0):
                    self._checkpoint(stop, is_best)
                    saved_at = self.state.step
            if saved_at != self.state.step:
                self._checkpoint(stop)
        return self._summary(stop, time.perf_counter() - t_start)

    def _log(
        self, result: StepResult, meter: Meter, monitor: Monitor, end: int, shown: dict[str, str]
    ) -> dict[str, str]:
        """On logging steps, loss and grad norm cross to the host (the only reads of them) and
        go to TensorBoard and the progress line; returns what the progress line shows."""
        log = self.state.step % self.cfg.train.log_every == 0 or self.state.step == end
        if log:
            note = meter.recheck_peak()
            if note and self.verbose:
                monitor.print(note)
            loss, grad_norm = float(result.loss), float(result.grad_norm)
            monitor.scalars(meter.scalars(loss, result.lr, grad_norm, self.state.skipped_steps),
                            self.state.step)  # fmt: skip
            shown = meter.stats(loss, result.lr)
            if self.expert_load is not None:
                monitor.scalars(self.expert_load.scalars(), self.state.step)
                self.expert_load.reset()
            if self.objective is not None:
                monitor.scalars(self.objective.scalars(), self.state.step)
        monitor.step(self.state.step, shown, log)
        if log:
            meter.reset()
        return shown

    def _snapshot_if_probing(self) -> list[torch.Tensor] | None:
        """Every log_every*10 steps, the blocks' weights before the step (not under FSDP: shards
        only), for the per-layer numbers after it."""
        tc = self.cfg.train
        probe = self.is_main and (self.state.step + 1) % (tc.log_every * 10) == 0
        probe = probe and not (self.dist.enabled and tc.parallel == "fsdp")
        probe = probe and self.objective is None  # activation RMS reads the token shards
        return block_snapshot(self.model) if probe else None

    def _log_layers(self, before: list[torch.Tensor] | None, monitor: Monitor) -> None:
        """Per-block update/weight ratio of this step and RMS of the block outputs."""
        if before is None:
            return
        x, _ = next(eval_batches(self.run.train_tokens, seq_len=self.cfg.train.seq_len,
                                 batch_size=1))  # fmt: skip
        stats = update_ratios(self.model, before)
        stats.update(activation_rms(self.model, x.to(self.device), self.autocast))
        monitor.scalars(stats, self.state.step)

    def _evaluate_if_due(self, monitor: Monitor) -> bool:
        """At eval_every and at max_steps: validation loss and task scores; whether it is the
        best validation loss so far."""
        tc, step = self.cfg.train, self.state.step
        if not ((tc.eval_every and step % tc.eval_every == 0) or step == tc.max_steps):
            return False
        with self.averaged():  # one swap for the validation loss and the task scores
            if self.objective is not None:  # its own held-out measure ({} for none)
                self.last_eval = self.objective.evaluate(self)
            else:
                self.last_eval = self._evaluate()
            monitor.scalars({f"val/{k}": v for k, v in self.last_eval.items()}, self.state.step)
            if self.objective is None:
                monitor.print(f"step {self.state.step}: val loss {self.last_eval['loss']:.4f}, "
                              f"bits/byte {self.last_eval['bits_per_byte']:.4f}")  # fmt: skip
            elif self.last_eval:
                shown = ", ".join(f"{k} {v:.4f}" for k, v in self.last_eval.items())
                monitor.print(f"step {self.state.step}: val {shown}")
            if self.probes is not None:
                self.probes.score_tasks(self.model, self.state.step, monitor)
        is_best = self.last_eval.get("loss", math.inf) < self.state.best_val
        if is_best:
            self.state.best_val = self.last_eval["loss"]
        return is_best

    def _probe(self, monitor: Monitor) -> None:
        """Samples of the model at the steps train.sample_every asks for."""
        if self.probes is not None and self.probes.due(self.state.step):
            with self.averaged():
                self.probes.write_samples(self.model, self.state.step, monitor)

    def _checkpoint(self, stop: StopSignal, is_best: bool = False) -> None:
        with stop.finishing(f"writing the checkpoint of step {self.state.step}"):
            self.save(is_best=is_best)

    def _summary(self, stop: StopSignal, elapsed: float) -> dict[str, Any]:
        summary = {
            "step": self.state.step,
            "tokens_seen": self.state.tokens_seen,
            "val": self.last_eval,
            "checkpoint": str(self.state.last_ckpt) if self.state.last_ckpt else None,
            "interrupted": stop.requested,
            "seconds": elapsed,
        }
        if self.verbose:
            how = f"stopped by {stop.signame}" if stop.requested else "done"
            print(f"{how} at step {self.state.step} after {format_duration(elapsed)}; "
                  f"checkpoint {summary['checkpoint']}")  # fmt: skip
        return summary

    @contextlib.contextmanager
    def _say_resume_point_if_cut(self) -> Iterator[None]:
        """A stop at once (a repeated Ctrl-C) says which checkpoint the next run resumes from."""
        try:
            yield
        except KeyboardInterrupt:
            if self.verbose:
                where = self.state.last_ckpt or "the start (no checkpoint yet)"
                warn(f"stopped at once after step {self.state.step}, which is not checkpointed; "
                     f"`minillm train` resumes from {where}")  # fmt: skip
            raise

    @property
    def resumed(self) -> bool:
        return self.run.resume_from is not None

    def close(self) -> None:
        """Release the run lock and leave the process group (idempotent)."""
        self.run.close()
        self._let_go_of_the_group()

    def _let_go_of_the_group(self) -> None:
        """Drop what still holds the process group, DDP's wrapper and FSDP2's mesh, so that the
        next collection frees it (see train()); the plain model stays for whoever reads it."""
        if hasattr(self, "model"):
            release_groups(self.model)
            self.train_model = self.model


def train(
    cfg: Config, resume: bool = True, force: bool = False, config_dir: Path | None = None
) -> dict[str, Any]:
    """What `minillm train` runs; config_dir: the config file's folder."""
    trainer = Trainer(prepare_run(cfg, resume=resume, force=force, config_dir=config_dir))
    try:
        result = trainer.fit()
        # Every rank leaves its last collective before any tears the group down: gloo aborts a
        # process whose peer closes the connection under it.
        barrier()
        return result
    finally:
        trainer.close()
        # DDP holds the process group in reference cycles, which Python would collect only while
        # the interpreter shuts down: gloo's worker threads, still running then, abort the
        # process when they free a tensor (they need the GIL of a dying interpreter). Collect
        # them now (close() let go of the wrapper, so this works even while an exception's
        # traceback keeps the trainer): the group's destructor joins its threads.
        del trainer
        gc.collect()
