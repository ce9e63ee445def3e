"""What a person watches during training: a rich progress bar (or plain lines) and TensorBoard.

Offers `Monitor` and `Meter` (tokens/s and MFU over a window of steps). Only rank 0 creates a
Monitor that writes; other ranks get a silent one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Console

from minillm.runtime.progress import Progress, format_duration


class Monitor:
    """Progress on the terminal (a live bar on a TTY, periodic lines otherwise) and TB scalars."""

    def __init__(
        self,
        run_dir: str | Path | None,
        total_steps: int,
        start_step: int,
        enabled: bool = True,
        console: Console | None = None,
    ) -> None:
        self.enabled = enabled
        self.console = console or Console(highlight=False)
        self.total = total_steps
        self.writer = None
        self.progress: Progress | None = None
        if not enabled:
            return
        if run_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            # A run resumed from step S after a crash logged steps > S before it died: purge
            # them, so that each tag's steps only go forward.
            purge = start_step + 1 if start_step > 0 else None
            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tb"), purge_step=purge)
        self.progress = Progress("step", total_steps, self.console, start=start_step)

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

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


class Meter:
    """Tokens per second and MFU over the steps since the last log line."""

    def __init__(self, flops_per_token: int, peak: float, world_size: int) -> None:
        self.flops_per_token, self.peak, self.world_size = flops_per_token, peak, world_size
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
