"""The commands that make a run: `minillm tokenize` (the tokenizer and token shards), `minillm
train` (the model) and `minillm info` (what a config's model, or a checkpoint's, costs)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from minillm.cli.command import Command, print_error, run
from minillm.cli.options import (
    BestOption,
    ConfigArgument,
    DtypeOption,
    SetOption,
    hub_ckpt,
    load_ckpt_config,
    load_config,
)
from minillm.cli.root import app


@app.command(cls=Command, short_help="Train the tokenizer (if absent) and write the token shards.")
def tokenize(
    config: Path = ConfigArgument,
    set_: list[str] | None = SetOption,
    retrain: bool = typer.Option(
        False,
        "--retrain",
        help="Train a new tokenizer even if data.tokenizer exists, and start over instead of "
        "resuming an interrupted run.",
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Encode the shards again even if they are up to date (same inputs and tokenizer).",
    ),
) -> None:
    """Train the tokenizer (if absent) and write the train/val token shards and meta.json.

    Shards already made from the same data settings, source files and tokenizer are left as
    they are ("nothing to do"); --force encodes them again, --retrain also retrains the tokenizer.
    """
    from minillm.data.summary import print_summary
    from minillm.data.tokenize_pass import write_shards

    cfg = load_config(config, set_, require_model=False)  # tokenize reads the data section only
    if not cfg.train.reads_shards:  # dpo, grpo read their jsonl when training starts
        print(f"nothing to tokenize: train.objective {cfg.train.objective} reads "
              f"{cfg.data.source} itself; run `minillm train {config}`")  # fmt: skip
        return
    summary = run(write_shards, cfg, retrain=retrain, reuse=not (force or retrain))
    if summary.get("up_to_date"):
        print(f"nothing to do: {summary['out_dir']} is up to date (its meta.json records these "
              "data settings, source files and tokenizer); --force encodes it again")  # fmt: skip
        return
    print_summary(summary)


@app.command(cls=Command, short_help="Train the model; Ctrl-C checkpoints, rerunning resumes.")
def train(
    config: Path = ConfigArgument,
    set_: list[str] | None = SetOption,
    resume: bool = typer.Option(
        True, "--resume/--no-resume", help="Continue from the run's latest checkpoint if any."
    ),
    force: bool = typer.Option(
        False, "--force", help="With --no-resume: delete the run's checkpoints and start over."
    ),
) -> None:
    """Train the model of CONFIG; Ctrl-C checkpoints and stops, running it again resumes.

    Under `torchrun --nproc_per_node N -m minillm train CONFIG` it trains with DDP or FSDP.
    """
    from minillm.train.trainer import train as run_training

    if force and resume:
        print_error("--force: only with --no-resume (it deletes the run's checkpoints)")
        raise typer.Exit(2)
    cfg = load_config(config, set_)
    summary = run(run_training, cfg, resume=resume, force=force, config_dir=config.parent)
    if summary.get("interrupted"):
        raise typer.Exit(130)


@app.command(cls=Command, short_help="Parameters, FLOPs per token and a memory estimate.")
def info(
    config: Path | None = typer.Argument(
        None, metavar="[CONFIG]", help="The YAML config (or --ckpt).", show_default=False
    ),
    set_: list[str] | None = SetOption,
    ckpt: Path | None = typer.Option(
        None,
        "--ckpt",
        metavar="PATH",
        help="Instead of CONFIG: a run (its newest checkpoint's config), a checkpoint or a "
        "Hugging Face folder (its config.json; the rest as a run with train.init_from PATH), "
        "or its Hub name org/name (config and tokenizer fetched into the Hugging Face cache).",
    ),
    best: bool = BestOption,
    dtype: str = DtypeOption,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Parameters, FLOPs per token and a training-memory estimate (nothing is allocated) of
    CONFIG's model, or of --ckpt's (a run, a checkpoint or a Hugging Face folder; no weights
    are read). The "fits: run" row is sized at --dtype, as `sample --dtype` loads the weights
    (auto: --ckpt's own; CONFIG's train.precision); the training rows at train.precision."""
    from minillm.checkpoint.lazy import resolve_dtype
    from minillm.info import model_info, print_info

    if (config is None) == (ckpt is None):
        given = "not both" if ckpt is not None else "one is required"
        print_error(f"CONFIG or --ckpt PATH: {given} (see `minillm info --help`)")
        raise typer.Exit(2)
    if best and ckpt is None:
        print_error("--best: only with --ckpt (a run directory)")
        raise typer.Exit(2)
    run_dtype = None if dtype == "auto" else run(resolve_dtype, dtype, None)
    if ckpt is not None:
        # A hub name: its config and tokenizer alone (info reads no weights), titled by name.
        local = hub_ckpt(ckpt, weights=False)
        cfg, title, stored = load_ckpt_config(local, best, set_)
        title = title if local == ckpt else str(ckpt)
        run_dtype = run_dtype or stored  # auto: the dtype sample would load it in
    else:
        cfg, title = load_config(config, set_), str(config)
    result = run(model_info, cfg, run_dtype=run_dtype)
    if as_json:
        print(json.dumps(result))
    else:
        print_info(result, title=title)
