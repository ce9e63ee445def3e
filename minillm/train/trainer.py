"""The training loop: `train(cfg, resume, force)` is what `minillm train` runs.

Offers `Trainer`, `StepResult`, `TrainingDiverged` and `train`. `prepare_run` (train/run.py)
resolves the run once, its objective included; `Trainer(run)` builds the model and optimizer from
it and `fit()` runs the loop, which reads top to bottom: train a step, log, evaluate, probe,
checkpoint.

The optimizer step is written once, here (`learn`), for every objective (lm, dpo, grpo: the
contract is minillm.train.objectives.common.Objective): the objective says what a step reads,
prepares it (GRPO's rollouts), counts what divides its loss and makes the loss of a micro-batch;
the Trainer sets the learning rate, all-reduces the counts, runs each micro-batch under `no_sync`
and autocast, adds the MoE load-balancing loss, scales (fp16), backpropagates, unscales, clips,
checks that the step is finite and steps (then moves a sigmoid router's bias by the step's
expert load, train.moe_bias_update). The batch of step s is a pure function of (seed, s,
rank, world size) and every other piece of state is in the checkpoint, so a resumed run
continues bit for bit.
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

from minillm.config import Config, dump_config
from minillm.errors import UserError, warn
from minillm.families import fused_rows
from minillm.model import Transformer, use_cpu_kernels
from minillm.model.lora import add_lora, token_ids_of, warn_unseen_chat_tokens
from minillm.model.moe import router_bias_scalars, router_stats, update_router_bias
from minillm.model.nf4 import quantize_nf4
from minillm.model.transformer import dropout_off
from minillm.runtime.device import StopSignal, autocast_context, make_grad_scaler, seed_everything
from minillm.runtime.files import atomic_write_text, copy_if_changed
from minillm.runtime.progress import format_duration
from minillm.tokenizer.conventions import copy_companions
from minillm.train.diagnostics import activation_rms, block_snapshot, update_ratios
from minillm.train.distributed import all_reduce_sum, barrier
from minillm.train.ema import WeightEMA
from minillm.train.monitor import ExpertLoad, Meter, Monitor, open_monitor
from minillm.train.objectives.common import StepResult
from minillm.train.optim import build_optimizer, newton_schulz_flops, set_lr
from minillm.train.parallel import no_sync, release_groups, wrap_model
from minillm.train.prefetch import Prefetcher
from minillm.train.run import Run, prepare_run
from minillm.train.state import TrainState, restore_train_state, save_train_state

_LABELS = {"bits_per_byte": "bits/byte", "reward_accuracy": "reward accuracy"}


class TrainingDiverged(UserError):
    """Too many non-finite steps in a row."""


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
        self.probes, self.objective = run.probes, run.objective
        tc = self.cfg.train
        seed_everything(tc.seed)  # the same initial weights on every rank
        # init_from's model was built lazily, its weights read once (minillm.checkpoint.lazy)
        model = run.init_weights if run.init_weights is not None else Transformer(self.cfg.model)
        self.model = use_cpu_kernels(model.train())  # eager CPU training kernels
        self.model.activation_checkpointing = tc.activation_checkpointing
        if run.init_weights is None and tc.zero_init_residual:  # a resume loads its own below
            with torch.no_grad():
                for w in self.model.residual_projections():
                    w.zero_()
        if tc.lora.rank:  # the base frozen, adapters on its linear layers: only they train
            add_lora(self.model, tc.lora, token_ids_of(tc.lora, run.tokenizer, run.tokenizer_file))
            chat = self.objective.chat and run.verbose
            warn_unseen_chat_tokens(self.model, tc.lora, run.tokenizer, chat)
            if tc.lora.quantize == "nf4":  # QLoRA: the frozen base in 4 bits
                quantize_nf4(self.model, fused_rows(self.cfg.model), "train.lora.quantize")
        self.model.to(self.device)
        # The objective's reference, if it has one, copies init_from's weights now, before a
        # resume loads the run's.
        self.objective.attach(self.model)
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
            restore_train_state(run, self.state, run.resume_from)
        else:
            # Dropout differs per rank; the weights above did not.
            torch.manual_seed(tc.seed + self.dist.rank)
        self.tokens_per_step = tc.batch_size * tc.grad_accum * tc.seq_len * self.dist.world_size
        # Muon's Newton-Schulz matmuls run on every rank; MFU counts them as work done.
        ns_flops = newton_schulz_flops(self.optimizer) * self.dist.world_size
        self.flops_per_token = (
            self.model.flops_per_token(tc.seq_len) + ns_flops / self.tokens_per_step
        )

    def _write_run_files(self) -> None:
        """config.yaml and tokenizer.json (with its companion files), once the loggers are open:
        a run that cannot open one (wandb without a login) leaves nothing behind; files already
        as they would be written are left alone (running a finished run again touches none)."""
        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config, tok = self.run_dir / "config.yaml", self.run_dir / "tokenizer.json"
        text = dump_config(self.cfg)
        if not config.is_file() or config.read_text(encoding="utf-8") != text:
            atomic_write_text(config, text)
        copy_if_changed(self.run.tokenizer_file, tok)
        # A published model's tokenizer_config.json, chat template and generation config.
        copy_companions(self.run.tokenizer_file.parent, self.run_dir)

    # ------------------------------------------------------------------ one step

    def train_step(self, batch: list[Any] | None = None) -> StepResult:
        """Run optimizer step `state.step` on `batch` (default: `batches(state.step)`): the
        objective prepares it (GRPO samples its rollouts), then `learn`."""
        step = self.state.step
        batch = self.batches(step) if batch is None else batch
        return self.learn(self.objective.prepare(self.model, step, batch))

    def learn(self, prepared: list[Any]) -> StepResult:
        """One optimizer step on the objective's prepared micro-batches: the one step of every
        objective. Deciding whether it was finite is the step's one host sync (and, under
        torchrun, reading back the summed normalisers)."""
        tc, obj, world = self.cfg.train, self.objective, self.dist.world_size
        lr = set_lr(self.optimizer, self.state.step, tc)
        counts = obj.normalisers(prepared)  # this rank's (e.g. target tokens), on the host
        if self.dist.enabled:  # the global batch's: summed on the device (NCCL), read back
            counts = all_reduce_sum(counts.to(self.device)).cpu()
        norms = counts.clamp(min=1.0)  # what the loss divides by: an empty count divides by 1
        totals: torch.Tensor | None = None
        inputs = 0  # this rank's input tokens
        dropout = contextlib.nullcontext() if obj.dropout else dropout_off(self.model)
        with dropout:
            for i, micro in enumerate(prepared):
                with no_sync(self.train_model, self.model, sync=i == len(prepared) - 1):
                    with self.autocast:
                        out = obj.loss(self.train_model, micro, norms)
                    # DDP/FSDP average gradients over ranks; multiplying by world size undoes it.
                    loss = out.loss * world
                    if self.expert_load is not None:
                        # The load-balancing loss of each micro-batch, weighted equally: the
                        # step's loss gets their mean (DDP then averages over ranks).
                        stats = router_stats(self.model)
                        aux = self.expert_load.add(stats)
                        if tc.moe_aux_loss:
                            loss = loss + tc.moe_aux_loss / len(prepared) * aux
                    (self.scaler.scale(loss) if self.scaler else loss).backward()
                totals = out.totals if totals is None else totals + out.totals
                inputs += out.inputs
        loss_mean = obj.step_loss(all_reduce_sum(totals), norms)
        norm, finite = self._clip_and_step(loss_mean)
        if self.expert_load is not None:
            load = self.expert_load.take_step()  # (L, E) tokens per expert, this step's
            if tc.moe_bias_update and finite:  # a skipped step moves no bias either
                update_router_bias(self.model, all_reduce_sum(load), tc.moe_bias_update)
        # Tokens processed (throughput, MFU, tokens_seen): with a target mask, more than targets.
        return StepResult(loss_mean, norm, lr, inputs * world, float(counts[0]), finite)

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

    def batches(self, step: int) -> list[Any]:
        """This rank's micro-batches of optimizer step `step`: the objective's, a pure function
        of seed, step, rank and world size (what a resume relies on)."""
        return self.objective.batches(step)

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
        """The objective's held-out measure (lm: loss, perplexity and bits per byte over the
        first eval_steps validation batches) of the weights a checkpoint saves."""
        with self.averaged():
            return self.objective.evaluate(self.model, self.autocast)

    def save(self, is_best: bool = False) -> Path | None:
        """Checkpoint the state after `state.step` completed steps (a collective under FSDP);
        the checkpoint's path, or None (other ranks, or weights not finite: nothing written)."""
        return save_train_state(self.run, self.state, is_best)

    # ------------------------------------------------------------------ the loop

    def fit(self, stop_at: int | None = None) -> dict[str, Any]:
        """Train until max_steps (or `stop_at`, or a signal); checkpoint on the way out."""
        tc = self.cfg.train
        end = min(tc.max_steps, stop_at) if stop_at is not None else tc.max_steps
        monitor, meter = open_monitor(self, end)  # wandb may refuse (no login): nothing written
        self._write_run_files()
        saved_at = self.state.step if self.state.last_ckpt is not None else -1
        prefetch = Prefetcher(self.batches, end, pin=self.device.type == "cuda")
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
                scalars = {**self.expert_load.scalars(), **router_bias_scalars(self.model)}
                monitor.scalars(scalars, self.state.step)
                self.expert_load.reset()
            own = self.objective.scalars()
            monitor.scalars(own, self.state.step)
            shown = _beside_loss(shown, own, self.objective.console)
            parts = self.objective.loss_parts(own)
            if parts and "loss" in shown:
                each = " + ".join(f"{label} {v:.4f}" for label, v in parts.items())
                shown["loss"] = f"{shown['loss']} ({each})"
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
        return block_snapshot(self.model) if probe else None

    def _log_layers(self, before: list[torch.Tensor] | None, monitor: Monitor) -> None:
        """Per-block update/weight ratio of this step and RMS of the block outputs."""
        if before is None:
            return
        stats = update_ratios(self.model, before)
        x = self.objective.probe_input()  # one row of the objective's inputs
        if x is not None:
            stats.update(activation_rms(self.model, x.to(self.device), self.autocast))
        monitor.scalars(stats, self.state.step)

    def _evaluate_if_due(self, monitor: Monitor) -> bool:
        """At eval_every and at max_steps: validation loss and task scores; whether it is the
        best validation loss so far."""
        tc, step = self.cfg.train, self.state.step
        if not ((tc.eval_every and step % tc.eval_every == 0) or step == tc.max_steps):
            return False
        with self.averaged():  # one swap for the validation loss and the task scores
            self.last_eval = self.objective.evaluate(self.model, self.autocast)  # {} for none
            monitor.scalars({f"val/{k}": v for k, v in self.last_eval.items()}, self.state.step)
            if self.last_eval:
                labels = {**_LABELS, **self.objective.val_labels}
                shown = ", ".join(f"{labels.get(k, k)} {v:.4f}" for k, v in self.last_eval.items()
                                  if k != "perplexity")  # fmt: skip
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
        """Release the run lock and leave the process group (idempotent); a run that wrote
        nothing (its loggers refused to open) also removes the folders it created, if empty."""
        self.run.close(failed=not (self.run_dir / "config.yaml").exists())
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


def _beside_loss(
    shown: dict[str, str], own: dict[str, float], console: dict[str, str]
) -> dict[str, str]:
    """The progress line's items with the objective's `console` scalars put right after loss."""
    extra = {label: f"{own[tag]:.3f}" for tag, label in console.items() if tag in own}
    out: dict[str, str] = {}
    for key, value in shown.items():
        out[key] = value
        if key == "loss":
            out.update(extra)
    return out if len(out) == len(shown) + len(extra) else {**shown, **extra}
