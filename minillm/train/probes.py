"""What a run shows besides its loss: task scores at each evaluation and samples every few steps.

Offers `TrainingProbes`, built by `TrainingProbes.create(cfg, tokenizer_file, ...)` (None when
`train.eval_tasks` and `train.sample_every` ask for nothing) and called by the Trainer:
`score_tasks(model, step, monitor)` after each evaluation, `write_samples(model, step, monitor)`
at the steps where `due(step)`. Rank 0 only: the other ranks go on to the next collective and
wait there.

Task files are read and tokenized once, at setup, so a bad file stops the run before its first
step and each evaluation costs only the forward passes. Samples are greedy and sampled at the
fixed seed train.seed, with the run's `sample` settings, so two runs (or two steps of one run)
are compared on the same draws.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from minillm.config import Config
from minillm.errors import UserError, warn
from minillm.families import model_conventions
from minillm.infer.engine import SamplingParams, generate
from minillm.infer.sample import encode_prompts
from minillm.infer.task_format import Task, read_tasks
from minillm.infer.task_scoring import (
    encode_multiple_choice,
    score_exact_match,
    score_multiple_choice,
)
from minillm.tokenizer.bpe import load_tokenizer
from minillm.tokenizer.conventions import Conventions
from minillm.train.monitor import Monitor


class TrainingProbes:
    """Task scores and samples of the model being trained, logged to TensorBoard and printed."""

    def __init__(
        self,
        cfg: Config,
        conv: Conventions,
        device: torch.device,
        autocast: contextlib.AbstractContextManager | None = None,
    ) -> None:
        tc = cfg.train
        tokenizer = conv.tok
        self.cfg, self.conv, self.tokenizer = cfg, conv, tokenizer
        self.device, self.autocast = device, autocast
        self.tasks: list[Task] = read_tasks(tc.eval_tasks, key="train.eval_tasks")
        self.noted: set[str] = set()  # the notes of exact-match scoring, each said once a run
        context = cfg.model.max_seq_len
        self.encoded = {
            t.name: encode_multiple_choice(tokenizer, t, context)
            for t in self.tasks
            if t.kind == "multiple_choice"
        }
        for task in self.tasks:
            if task.kind == "exact_match":
                conv.check_chat(f"train.eval_tasks: {task.path}")  # a chat model?
        self.prompts: list[list[int]] = []
        if tc.sample_every:
            self.prompts = encode_prompts(conv, tc.sample_prompts, context)
            longest = max(len(p) for p in self.prompts)
            if longest + tc.sample_max_new_tokens - 1 > context:
                raise UserError(
                    f"train.sample_max_new_tokens: {tc.sample_max_new_tokens} new tokens after a "
                    f"prompt of {longest} exceed the model's context of {context}"
                )

    @classmethod
    def create(
        cls,
        cfg: Config,
        tokenizer_file: str | Path,
        device: torch.device,
        autocast: contextlib.AbstractContextManager | None = None,
        *,
        main: bool = True,
        sharded: bool = False,
    ) -> TrainingProbes | None:
        """The probes a config asks for, on rank 0 (`main`); None elsewhere or when nothing is
        asked for. Every rank reads the files, so a bad one stops all ranks alike. sharded
        (FSDP): rank 0 alone cannot run the model, so there are none, with a warning."""
        tc = cfg.train
        if not tc.eval_tasks and not tc.sample_every:
            return None
        tok = load_tokenizer(tokenizer_file)
        conv = model_conventions(tok, Path(tokenizer_file).parent, cfg.model)
        probes = cls(cfg, conv, device, autocast)  # checks the files
        if sharded and main:
            warn(
                "train.eval_tasks and train.sample_every are skipped under FSDP (rank 0 "
                "holds a shard of the model); score checkpoints with `minillm eval --task`"
            )
        return probes if main and not sharded else None

    def score_tasks(self, model: torch.nn.Module, step: int, monitor: Monitor) -> dict[str, float]:
        """Score every task file; log val/tasks/<name>/<metric> and print one line per task."""
        tc = self.cfg.train
        scalars = {}
        for task in self.tasks:
            start = time.perf_counter()
            if task.kind == "multiple_choice":
                result = score_multiple_choice(
                    model, task, self.encoded[task.name], tc.batch_size, self.device, self.autocast
                )
                shown = f"accuracy_norm {result['accuracy_norm']:.4f}, "
                shown += f"accuracy {result['accuracy']:.4f}"
            else:
                was_training = model.training
                model.eval()  # generation refuses live dropout
                try:
                    result = score_exact_match(
                        model, self.conv, task, tc.batch_size, tc.sample_max_new_tokens,
                        limit_name="train.sample_max_new_tokens", noted=self.noted,
                    )  # fmt: skip
                finally:
                    model.train(was_training)
                shown = f"exact_match {result['exact_match']:.4f}"
            seconds = time.perf_counter() - start
            for key, value in result.items():
                if key != "examples":
                    scalars[f"val/tasks/{task.name}/{key}"] = value
            monitor.print(
                f"step {step}: {task.name} {shown} ({result['examples']} examples, {seconds:.1f}s)"
            )
        monitor.scalars(scalars, step)
        return scalars

    def due(self, step: int) -> bool:
        """Whether step `step` (completed steps) is a sampling step."""
        every = self.cfg.train.sample_every
        return bool(every) and (step % every == 0 or step == self.cfg.train.max_steps)

    def write_samples(
        self, model: torch.nn.Module, step: int, monitor: Monitor
    ) -> dict[str, list[str]]:
        """Greedy and sampled continuations of each prompt: TB text samples/greedy and
        samples/sampled, and printed."""
        tc, sc = self.cfg.train, self.cfg.sample
        start = time.perf_counter()
        vocab = self.tokenizer.get_vocab_size()
        texts: dict[str, list[str]] = {}
        was_training = model.training
        model.eval()
        try:
            for kind, temperature in (("greedy", 0.0), ("sampled", sc.temperature)):
                if kind == "sampled" and temperature == 0.0:
                    continue  # sample.temperature 0 is greedy: nothing new to show
                params = SamplingParams(
                    tc.sample_max_new_tokens,
                    temperature,
                    sc.top_k,
                    sc.top_p,
                    seed=tc.seed,
                    stop_ids=self.conv.text_stops,
                )
                new = generate(model, self.prompts, params, vocab_limit=vocab)
                texts[kind] = [self.tokenizer.decode(ids) for ids in new]
        finally:
            model.train(was_training)
        prompts = tc.sample_prompts or [""]
        seconds = time.perf_counter() - start
        for kind, outs in texts.items():
            # One fenced block per prompt: TensorBoard's markdown would join the lines of verse.
            blocks = [f"```\n{p}{o}\n```" for p, o in zip(prompts, outs)]
            monitor.text(f"samples/{kind}", "\n\n".join(blocks), step)
            for p, o in zip(prompts, outs):
                monitor.print(f"step {step} {kind}: {p + o!r}")
        monitor.print(f"step {step}: samples took {seconds:.1f}s")
        return texts
