"""What a person watches during training: a rich progress bar (or plain lines), and the scalars
and texts in TensorBoard and/or Weights & Biases (`train.log_to`).

Offers `Monitor`, `Meter` (tokens/s and MFU over a window of steps), `ExpertLoad` (a mixture of
experts' routing over the same window) and `open_monitor(trainer, end)` (a Monitor and a Meter,
for a Trainer's loop, with the run's opening lines). Only rank 0 creates a Monitor that writes;
other ranks get a silent one.
"""

from __future__ import annotations

import functools
import html
import math
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from rich.console import Console

from minillm.config import Config, ConfigError, config_to_dict, dump_config
from minillm.errors import warn
from minillm.model import Transformer
from minillm.model.moe import RouterStats, load_balancing_loss
from minillm.model.param_groups import describe
from minillm.runtime.files import atomic_write_text
from minillm.runtime.perf import peak_flops, reprobe_peak
from minillm.runtime.progress import Progress, format_duration
from minillm.train.distributed import DistInfo


class Monitor:
    """Progress on the terminal (a live bar on a TTY, periodic lines otherwise), and scalars and
    texts to the loggers of `log_to` (tensorboard, wandb) when there is a `run_dir`."""

    def __init__(
        self,
        run_dir: str | Path | None,
        total_steps: int,
        start_step: int,
        enabled: bool = True,
        console: Console | None = None,
        log_to: Sequence[str] = ("tensorboard",),
        config: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.console = console or Console(highlight=False)
        self.total = total_steps
        self.writer = None
        self.wandb: Any = None  # a wandb Run
        self.progress: Progress | None = None
        if not enabled:
            return
        if run_dir is not None and "wandb" in log_to:  # first: a missing extra writes nothing
            self.wandb = open_wandb(Path(run_dir), config, resume=start_step > 0)
        if run_dir is not None and "tensorboard" in log_to:
            from torch.utils.tensorboard import SummaryWriter

            # A run resumed from step S after a crash logged steps > S before it died: purge
            # them, so that each tag's steps only go forward.
            purge = start_step + 1 if start_step > 0 else None
            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tb"), purge_step=purge)
        self.progress = Progress("step", total_steps, self.console, start=start_step)

    def scalars(self, values: dict[str, float], step: int) -> None:
        finite = {k: v for k, v in values.items() if v is not None and math.isfinite(v)}
        if self.writer is not None:
            for tag, value in finite.items():
                self.writer.add_scalar(tag, value, step)
        if self.wandb is not None and finite:
            self.wandb.log({**finite, "step": step})

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Html(f"<pre>{html.escape(text)}</pre>"), "step": step})

    def step(self, step: int, stats: dict[str, Any], log: bool) -> None:
        """Advance to `step` (completed steps); off a terminal, print a plain line when `log`."""
        if self.progress is None:
            return
        line = "  ".join(f"{k} {v}" for k, v in stats.items())
        if self.progress.bar is not None:
            self.progress.update(step, info=line)
        elif log:
            self.progress.done = step
            eta = self.progress.eta()
            print(f"step {step}/{self.total}  {line}  eta {format_duration(eta)}", flush=True)

    def print(self, message: str) -> None:
        if self.progress is not None:
            self.progress.print(message)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def open_wandb(run_dir: Path, config: dict[str, Any] | None, resume: bool) -> Any:
    """A Weights & Biases run named after the run directory, its files under <run_dir>/wandb
    (what WANDB_MODE=offline keeps), or under $WANDB_DIR/wandb when the user set WANDB_DIR
    (wandb's own convention: every run's files in one place), the config logged; a resumed run
    goes on in the same one (its id kept in <run_dir>/wandb/minillm_run_id either way).

    Every value is logged with `step`, the charts' x-axis: W&B's own step only goes forward, and
    a resume after a crash logs again the steps after its checkpoint."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "train.log_to",
            "wandb is not installed: pip install wandb (the extra `wandb`), or leave wandb out "
            "of train.log_to",
        ) from None
    id_file = run_dir / "wandb" / "minillm_run_id"  # the W&B run a resume goes on with
    run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
    try:
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "minillm",
            name=run_dir.name,
            dir=os.environ.get("WANDB_DIR") or str(run_dir),
            id=run_id or secrets.token_hex(4),
            resume="allow",
            config=config,
        )
    except wandb.errors.Error as e:  # no API key, no network, ...: the user's setup to fix
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            "train.log_to",
            f"wandb could not start a run: {first} (`wandb login`, or WANDB_MODE=offline)",
        ) from None
    if run.id != run_id:
        id_file.parent.mkdir(parents=True, exist_ok=True)  # wandb's files may be elsewhere
        atomic_write_text(id_file, run.id + "\n")
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run


class ExpertLoad:
    """A mixture of experts' routing over the steps since the last log line: the
    load-balancing loss and, per layer, the fraction of tokens routed to each expert (k/E each
    when balanced), as TensorBoard scalars xray/moe/aux_loss and
    xray/moe/layer{i}/expert{e} (i counts the sparse blocks: model.moe_dense_layers have no
    router), and the extremes of load / mean load over layers and experts
    (xray/moe/load_max_ratio, load_min_ratio). `take_step` gives one optimizer step's counts
    (train.moe_bias_update moves the routing bias by them)."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.step_counts: torch.Tensor | float = 0.0  # (L, E) since the last take_step
        self.reset()

    def reset(self) -> None:
        self.aux, self.micro_batches = 0.0, 0
        self.counts: torch.Tensor | float = 0.0  # (L, E) tokens per expert, on the device
        self.tokens = 0

    def add(self, stats: list[RouterStats]) -> torch.Tensor:
        """Record one forward's routing (`router_stats(model)`); returns its load-balancing
        loss, differentiable. Nothing here waits for the device."""
        aux = load_balancing_loss(stats, self.n_experts)
        self.aux = self.aux + aux.detach()
        # Stacked now: a recompute in backward would rewrite the routers' counts.
        counts = torch.stack([s.counts for s in stats])
        self.counts = self.counts + counts
        self.step_counts = self.step_counts + counts
        self.tokens += stats[0].tokens
        self.micro_batches += 1
        return aux

    def take_step(self) -> torch.Tensor | float:
        """The tokens per expert (L, E) routed by this step's micro-batches; starts the next."""
        counts, self.step_counts = self.step_counts, 0.0
        return counts

    def scalars(self) -> dict[str, float]:
        if not self.micro_batches:
            return {}
        out = {"xray/moe/aux_loss": float(self.aux) / self.micro_batches}
        # The most and least loaded expert of any layer against its layer's mean (1 = balanced).
        ratio = self.counts / self.counts.mean(dim=1, keepdim=True).clamp(min=1e-9)
        out["xray/moe/load_max_ratio"] = float(ratio.max())
        out["xray/moe/load_min_ratio"] = float(ratio.min())
        load = (self.counts / self.tokens).tolist()
        for i, layer in enumerate(load):
            out.update({f"xray/moe/layer{i}/expert{e}": f for e, f in enumerate(layer)})
        return out


class Meter:
    """Tokens per second and MFU over the steps since the last log line."""

    def __init__(
        self,
        flops_per_token: int,
        peak: float,
        world_size: int,
        reprobe: Callable[[], float] | None = None,
    ) -> None:
        self.flops_per_token, self.peak, self.world_size = flops_per_token, peak, world_size
        self.reprobe = reprobe  # for a probed peak: probe again (once), returns the new peak
        self.reset()

    def reset(self) -> None:
        self.tokens, self.seconds = 0.0, 0.0

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over the peak of all devices (MFU, as in the PaLM paper)."""
        from minillm.runtime.perf import mfu

        if not self.peak:
            return math.nan
        return mfu(self.flops_per_token, self.tokens_per_sec, self.peak * self.world_size)

    def recheck_peak(self) -> str | None:
        """MFU above 100% means the probed peak read too low (a busy machine when it was
        probed): probe once more, keep the higher (cached) and say so; else None."""
        if self.reprobe is None or not self.mfu > 1.0:
            return None
        reprobe, self.reprobe = self.reprobe, None
        before, old = self.mfu, self.peak
        self.peak = max(old, reprobe())
        return (
            f"MFU {100 * before:.0f}% against the cached peak of {old / 1e9:.0f} GFLOP/s, "
            f"probed on a busy machine: probed again, {self.peak / 1e9:.0f} GFLOP/s (cached)"
        )

    def scalars(self, loss: float, lr: float, grad_norm: float, skipped: int) -> dict[str, float]:
        """The TensorBoard scalars of a logging step."""
        return {
            "train/loss": loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/tokens_per_sec": self.tokens_per_sec,
            "train/mfu": self.mfu,
            "train/skipped_steps": skipped,
        }

    def stats(self, loss: float, lr: float) -> dict[str, str]:
        """The progress line's numbers of a logging step."""
        stats = {
            "loss": f"{loss:.4f}",
            "lr": f"{lr:.2e}",
            "tok/s": f"{self.tokens_per_sec:,.0f}",
        }
        if math.isfinite(self.mfu):
            stats["mfu"] = f"{100 * self.mfu:.1f}%"
        return stats


class Watched(Protocol):
    """What the opening lines and the meter read of a Trainer (a Protocol: no import of it)."""

    cfg: Config
    model: Transformer
    run_dir: Path
    device: torch.device
    precision: str
    tf32: bool
    init_label: str | None  # init_from's weights, as loaded (None: from the seed, or resumed)
    dist: DistInfo
    state: Any  # the TrainState (state -> run -> probes -> monitor): its step, where the run starts
    is_main: bool
    verbose: bool
    flops_per_token: float
    tokens_per_step: int

    @property
    def resumed(self) -> bool: ...


def open_monitor(trainer: Watched, end: int) -> tuple[Monitor, Meter]:
    """A trainer's TensorBoard and console output, its throughput meter, and the opening lines
    (the banner; a warmup that outlasts the run; nothing left to train)."""
    tc = trainer.cfg.train
    # Nothing to train: no logger, so no new, empty events file in tb/ (nor W&B run).
    tb_dir = trainer.run_dir if trainer.state.step < end else None
    monitor = Monitor(
        tb_dir,
        tc.max_steps,
        trainer.state.step,
        enabled=trainer.is_main,
        log_to=tc.log_to,
        config=config_to_dict(trainer.cfg),
    )
    if trainer.state.step == 0:
        monitor.text("config", "```yaml\n" + dump_config(trainer.cfg) + "```")
    peak, peak_source = 0.0, ""
    if trainer.is_main:
        peak, peak_source = peak_flops(trainer.device, trainer.precision, tc.peak_flops)
    reprobe = None
    # A CPU's fp32 probe is what an fp32 run's FLOP/s can be held against (bf16 there may run on
    # units the probe does not use); on a GPU the run's memory may leave no room for a probe.
    cpu_fp32 = trainer.device.type == "cpu" and trainer.precision == "fp32"
    if peak_source.startswith("probed") and cpu_fp32:
        reprobe = functools.partial(reprobe_peak, trainer.device, trainer.precision)
    meter = Meter(trainer.flops_per_token, peak, trainer.dist.world_size, reprobe)
    if trainer.verbose:
        monitor.print(banner(trainer, meter.peak, peak_source))
        if tc.warmup_steps >= tc.max_steps and trainer.state.step < tc.max_steps:
            warn(f"train.warmup_steps={tc.warmup_steps} >= train.max_steps={tc.max_steps}: "
                 "the run ends while the lr still rises, before any decay; lower "
                 f"warmup_steps (e.g. {max(tc.max_steps // 10, 1)})")  # fmt: skip
        if trainer.state.step >= tc.max_steps:
            monitor.print(
                f"the run is already at step {trainer.state.step}, train.max_steps is "
                f"{tc.max_steps}: nothing to train (raise max_steps to go on)"
            )
    return monitor, meter


def banner(trainer: Watched, peak: float, peak_source: str) -> str:
    """The first line of a run: model, device, precision, batch, peak FLOP/s, run dir."""
    tc = trainer.cfg.train
    n = trainer.model.param_count()
    return (
        f"training {n / 1e6:.2f}M parameters on {trainer.device} ({trainer.precision}"
        f"{', compiled' if tc.compile else ''}{', TF32 matmuls' if trainer.tf32 else ''}"
        f"{', activation checkpointing' if tc.activation_checkpointing else ''}"
        f"{f', {trainer.dist.world_size} ranks, {tc.parallel}' if trainer.dist.enabled else ''}); "
        f"global batch {tc.batch_size}x{tc.grad_accum}x{trainer.dist.world_size} seqs of "
        f"{tc.seq_len} = {trainer.tokens_per_step:,} tokens/step; "
        f"peak {peak / 1e9:.0f} GFLOP/s for MFU ({peak_source}); run dir {trainer.run_dir}"
        + (f"; weights from {trainer.init_label}" if trainer.init_label else "")
        + f"\n{describe(trainer.model, tc)}"
    )
