"""Where a run resumes, and what a resume may change: the train stage's policy over the run's
checkpoints (minillm.checkpoint stores and loads them).

Offers `resume_point` (which checkpoint a `minillm train` continues from, or None to start
afresh), `resume_differences(old, new) -> (refused, changed)`, `schedule_change` (the warning for
a resume whose new schedule makes the learning rate jump) and the key sets they use.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

from minillm.checkpoint import layout
from minillm.checkpoint import store as ckpt
from minillm.config import Config, config_from_dict, config_to_dict
from minillm.errors import ConfigError, UserError, warn
from minillm.train.schedule import schedule_lr

# train.lora: another rank or other targets are other tensors (and LoRA on or off another run).
REFUSED_KEYS = {"data.vocab_size", "train.optimizer", "train.lora"}
# Keys a resumed run may change without a word: they only move the end or the cadence.
SCHEDULE_KEYS = {
    "train.max_steps",
    "train.eval_every",
    "train.eval_steps",
    "train.ckpt_every",
    "train.keep_last",
    "train.log_every",
    "train.max_bad_steps",
    "train.peak_flops",
    "train.device",
    "train.compile",
    "train.out_dir",
    "train.parallel",  # a change of world size or wrapping is reported on its own
}


# Keys that shape the learning-rate schedule (some arrive with other issues; absent ones never
# differ). A resume that changes them redraws the curve, and may make the lr jump.
LR_SCHEDULE_KEYS = (
    "train.lr",
    "train.min_lr",
    "train.warmup_steps",
    "train.max_steps",
    "train.schedule",
    "train.decay_fraction",
)


def _flatten(cfg: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, section in cfg.items() for k, v in section.items()}


def resume_differences(old: dict[str, Any], new: Config) -> tuple[list[str], list[str]]:
    """Keys whose change refuses a resume (architecture, tokenizer) and keys that merely changed.

    `old` is the config dict saved with the checkpoint.
    """
    with contextlib.suppress(ConfigError):  # resolve nulls (n_kv_head, ...) as `new` has them
        old = config_to_dict(config_from_dict(old))
    before, after = _flatten(old), _flatten(config_to_dict(new))
    refused, changed = [], []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if isinstance(a, list):
            a = tuple(a)
        if isinstance(b, list):
            b = tuple(b)
        if a == b or key in SCHEDULE_KEYS:
            continue
        if key == "model.family" and a is None:  # saved before families were stored: resolved
            continue
        entry = f"{key} ({a!r} -> {b!r})"
        # The optimizer's state has another shape (Muon keeps one buffer, AdamW two moments).
        if (key.startswith("model.") and key != "model.dropout") or key in REFUSED_KEYS:
            refused.append(entry)
        else:
            changed.append(entry)
    return refused, changed


# How far the resume step's lr may sit from where the run's own schedule has it before the resume
# warns: a 1% difference changes nothing a user would notice, a redrawn cosine moves it far more.
LR_JUMP_TOLERANCE = 0.01


def _distinct(*values: float) -> list[str]:
    """The values at the fewest significant digits (3 or more) that tell unequal ones apart."""
    for digits in range(3, 10):
        text = [f"{v:.{digits}g}" for v in values]
        if all((a == b) == (x == y) for a, x in zip(text, values) for b, y in zip(text, values)):
            return text
    return [repr(v) for v in values]


def schedule_change(old: dict[str, Any], new: Config, step: int) -> str | None:
    """A warning when resuming at `step` makes the learning rate jump: the new schedule gives
    step `step` an lr more than LR_JUMP_TOLERANCE away from the one the run's own schedule gives
    it (raising max_steps re-stretches the cosine, so the lr jumps back up); else None.

    The schedule's own change from step-1 to step is no jump, and neither is a difference over
    steps already taken that the resume step does not feel (a resume at step 0, a run with
    nothing left to train). `old` is the config dict saved with the checkpoint. Names the keys
    that changed.
    """
    try:
        old_train = config_from_dict(old).train
    except ConfigError:
        return None
    if step <= 0 or step >= new.train.max_steps:
        return None
    was = schedule_lr(step - 1, old_train)
    expected, now = schedule_lr(step, old_train), schedule_lr(step, new.train)
    if abs(now - expected) <= LR_JUMP_TOLERANCE * max(abs(expected), abs(was)):
        return None
    before, after = _flatten(old), _flatten(config_to_dict(new))
    keys = [
        f"{k} ({before.get(k)!r} -> {after.get(k)!r})"
        for k in LR_SCHEDULE_KEYS
        if before.get(k) != after.get(k)
    ]
    was_s, expected_s, now_s = _distinct(was, expected, now)
    return (
        f"resuming at step {step} with {', '.join(keys) or 'another schedule'} makes the "
        f"learning rate jump: the lr goes from {was_s} at step {step - 1} to {now_s} at step "
        f"{step}, where the run's schedule has {expected_s} (the schedule is redrawn over the "
        "new run, not extended)"
    )


def resume_point(
    run_dir: Path,
    cfg: Config,
    tokenizer_file: str | Path,
    tokenizer_sha: str,
    world_size: int,
    *,
    resume: bool,
    force: bool,
    clear: bool,
    verbose: bool,
    latest: Path | None = None,
) -> Path | None:
    """The checkpoint a run continues from, or None to start afresh.

    Starting over a run that has checkpoints needs `resume=False` and `force`; then (where
    `clear`, i.e. on rank 0) its checkpoints and TensorBoard files are deleted. A checkpoint whose
    architecture or tokenizer differs from `cfg` is refused, naming the keys, and so is one whose
    state.json model config disagrees with its weights'. A new schedule that makes the learning
    rate jump at the resume step is warned about. `latest`: the run's newest intact checkpoint
    when the caller has already looked it up (`layout.find_latest` checks its sha256: once per
    run is enough).
    """
    ckpt_root = run_dir / layout.CKPT_DIR
    if not layout.list_checkpoints(ckpt_root):
        return None
    if not resume:
        if not force:
            raise UserError(
                f"{run_dir}: has checkpoints; --no-resume starts over only with --force"
            )
        if clear:
            names = [p.name for p in layout.list_checkpoints(ckpt_root)]
            span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            warn(
                f"{run_dir}: --no-resume --force: deleting {len(names)} checkpoint(s) ({span}) "
                "and the TensorBoard logs (tb/)"
            )
            shutil.rmtree(ckpt_root)
            shutil.rmtree(run_dir / "tb", ignore_errors=True)
        return None
    found = latest if latest is not None else layout.find_latest(run_dir)
    if found is None:
        return None
    state = layout.read_state(found)
    ckpt.check_model_config(found, state)
    refused, changed = resume_differences(state["config"], cfg)
    if state.get("tokenizer_sha256") not in (None, tokenizer_sha):
        refused.append(f"tokenizer ({tokenizer_file} differs from the run's)")
    if refused:
        raise UserError(
            f"{found}: cannot resume with a different architecture, tokenizer or optimizer: "
            + "; ".join(refused)
            + f". To train this config, give it a new train.out_dir (or start over in {run_dir} "
            "with --no-resume --force, which deletes its checkpoints)"
        )
    redrawn = None
    if verbose:
        redrawn = schedule_change(state["config"], cfg, int(state.get("step", 0)))
    if redrawn:
        warn(redrawn)  # it names the schedule keys, which the line below then leaves out
        changed = [c for c in changed if c.split(" ", 1)[0] not in LR_SCHEDULE_KEYS]
    if changed and verbose:
        warn(f"resuming with changed settings: {'; '.join(changed)}")
    old_world = state.get("world_size", 1)
    old_train = state["config"].get("train", {})
    old_global = old_train.get("batch_size", 0) * old_train.get("grad_accum", 0) * old_world
    new_global = cfg.train.batch_size * cfg.train.grad_accum * world_size
    if old_global != new_global and verbose:
        # The windows of a step depend on the global batch alone, not on how it is split.
        warn(
            f"resuming a run of global batch {old_global} sequences (world size {old_world}) "
            f"with {new_global} (world size {world_size}): the batches differ from here on"
        )
    return found
