"""The options several `minillm` commands share, and the two loads they feed.

`ConfigArgument` and `SetOption` (a YAML config and its `--set` overrides, read by
`load_config`); `CkptOption`, `BestOption`, `DeviceOption`, `QuantizeOption`, `DtypeOption`
and `ContextSetOption` (a checkpoint or a Hugging Face folder on a device, in its own dtype,
another or int8, at its own context or another, read by `load_ckpt`; its config alone, by
`load_ckpt_config`), given together to a command by `ckpt_options` as one `CkptChoice`;
`TemperatureOption`, `TopKOption` and `TopPOption` (`sample` and `chat`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from minillm.cli.command import run

if TYPE_CHECKING:
    import torch

SetOption = typer.Option(
    None,
    "--set",
    metavar="KEY=VALUE",
    help="Override a config value: section.key=value (repeatable).",
)
# --set on a command that reads a checkpoint (eval, sample, chat, serve): only the keys that
# position tokens, which no weight depends on (minillm.checkpoint.store.at_context).
ContextSetOption = typer.Option(
    None,
    "--set",
    metavar="KEY=VALUE",
    help="Read the checkpoint with a model key no weight depends on changed: "
    "model.max_seq_len or model.rope_scaling.* (e.g. model.rope_scaling.type=yarn), to use "
    "it past its trained context. Repeatable.",
)
ConfigArgument = typer.Argument(..., metavar="CONFIG", help="The YAML config.", show_default=False)

# The running command's context, which --ckpt's callback keeps so that `load_ckpt` can say what
# a Hugging Face folder lacks for it (by the time the command loads, every option is parsed).
_ckpt_command: ContextVar[typer.Context | None] = ContextVar("ckpt_command", default=None)


def hub_ckpt(value: Path | None, weights: bool = True) -> Path | None:
    """--ckpt as a local folder: a Hugging Face Hub name (`org/name`, no such folder here)
    fetched into the hub's cache (minillm.checkpoint.hub); what cannot be is one error line."""
    if value is None:
        return None
    from minillm.checkpoint.hub import resolve_model_path

    return run(resolve_model_path, value, weights)


def _remember_command(ctx: typer.Context, value: Path) -> Path:
    _ckpt_command.set(ctx)
    ctx.call_on_close(lambda: _ckpt_command.set(None))
    return hub_ckpt(value)


CkptOption = typer.Option(
    ...,
    "--ckpt",
    metavar="PATH",
    help="A run directory (its newest intact checkpoint), one checkpoint folder, a run's "
    "checkpoints/LATEST or checkpoints/BEST, or a Hugging Face folder of Llama, Qwen2, "
    "Qwen3, Mistral, Mixtral, Gemma 3 (text) or Phi-3 (config.json, safetensors, "
    "tokenizer.json; its chat template and eos are used), or its Hub name org/name "
    "(downloaded into the Hugging Face cache; HF_TOKEN, HF_HUB_OFFLINE, HF_HUB_CACHE).",
    callback=_remember_command,
)
BestOption = typer.Option(
    False, "--best", help="With a run directory: its best checkpoint (lowest val loss)."
)
DeviceOption = typer.Option(
    "auto", "--device", metavar="DEVICE", help="auto (cuda, then mps, then cpu), cpu, cuda."
)
QuantizeOption = typer.Option(
    "none",
    "--quantize",
    metavar="KIND",
    help="int8: the linear layers' weights in 8 bits, faster decoding on a CPU (fbgemm's "
    "kernel; the demo model's logits move by 0.4%; fp32 with a warning where the kernel is "
    "missing); nf4: the blocks' linear layers in 4-bit NF4 (bitsandbytes, CPU or CUDA; a "
    "quarter of bf16's memory, slower than fp32 on a CPU); none: fp32. The checkpoint is "
    "unchanged.",
)

DtypeOption = typer.Option(
    "auto",
    "--dtype",
    metavar="DTYPE",
    help="auto (the weights' own: a Hugging Face folder's config.json dtype, a run's float32), "
    "float32, bfloat16 or float16: the weights and the KV cache in it. bfloat16 halves the "
    "memory; on a CPU without bf16 instructions (no AMX/avx512_bf16) float32 decodes faster.",
)


@dataclass
class CkptChoice:
    """The checkpoint --ckpt (with --best) names, and how --device, --quantize, --dtype and --set
    (`context`) ask to load it (`load`)."""

    path: Path
    best: bool
    device: str
    quantize: str
    context: list[str] | None
    dtype: str = "auto"

    def load(self, seq_len: int | None = None) -> Any:
        """The checkpoint, loaded as the options say (`load_ckpt`; eval's --seq-len too)."""
        return load_ckpt(
            self.path, self.device, self.best, self.quantize, self.context, seq_len, self.dtype
        )


def ckpt_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with the options of a command that loads a checkpoint to run it (eval, sample,
    chat, serve), declared once here: --ckpt and --best before its own options, --device,
    --quantize, --dtype and --set after them; it takes them as one parameter `ckpt: CkptChoice`."""
    own = inspect.signature(command, eval_str=True).parameters.values()

    def option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
        return inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
        )

    params = [
        option("ckpt", Path, CkptOption),
        option("best", bool, BestOption),
        *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own if p.name != "ckpt"),
        option("device", str, DeviceOption),
        option("quantize", str, QuantizeOption),
        option("dtype", str, DtypeOption),
        option("overrides", list[str] | None, ContextSetOption),
    ]

    @functools.wraps(command)
    def with_ckpt(
        *,
        ckpt: Path,
        best: bool,
        device: str,
        quantize: str,
        dtype: str,
        overrides: list[str] | None,
        **rest,
    ) -> None:
        command(ckpt=CkptChoice(ckpt, best, device, quantize, overrides, dtype), **rest)

    # typer reads a command's options from its signature and type hints: these, not `command`'s
    with_ckpt.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    with_ckpt.__annotations__ = {p.name: p.annotation for p in params}
    return with_ckpt


# Sampling options shared by `sample` and `chat` (defaults: the run's sample section).
TemperatureOption = typer.Option(
    None, "--temperature", metavar="T", help="0 = greedy (default: sample.temperature)."
)
TopKOption = typer.Option(
    None,
    "--top-k",
    metavar="K",
    help="Keep the k most likely tokens, 0 = off (default: sample.top_k).",
)
TopPOption = typer.Option(
    None, "--top-p", metavar="P", help="Nucleus mass in (0, 1], 1 = off (default: sample.top_p)."
)


def load_config(path: Path, overrides: list[str] | None, require_model: bool = True) -> Any:
    """CONFIG with its --set overrides and train.init_from applied, as `train` reads it (a user
    error: exit 2); not through minillm.train, which `tokenize` and `info` do not import.
    require_model=False: a config without a model section is accepted (tokenize reads data)."""
    from minillm.checkpoint.init_from import load_run_config

    return run(load_run_config, path, overrides or [], require_model=require_model)


def load_ckpt_config(
    ckpt: Path, best: bool, overrides: list[str] | None
) -> tuple[Any, str, torch.dtype]:
    """--ckpt's config without its weights, what it is, and the dtype `--dtype auto` loads it in
    (`info --ckpt`; a user error: exit 2): a run's (its newest intact checkpoint, with --best
    the one BEST names) or a checkpoint's resolved config, state.json's; a Hugging Face
    folder's model, config.json's, with the other sections a run with `train.init_from:
    FOLDER` would take by default (train.seq_len capped at the model's context). --set
    overrides train, data and sample."""
    return run(_ckpt_config, ckpt, best, overrides or [])


def _ckpt_config(ckpt: Path, best: bool, overrides: list[str]) -> tuple[Any, str, torch.dtype]:
    import dataclasses

    from minillm.checkpoint.hf_import import hf_model_config
    from minillm.checkpoint.layout import STATE_FILE, is_hf_folder, read_state, resolve_checkpoint
    from minillm.checkpoint.store import auto_dtype, check_model_config
    from minillm.config import (
        ConfigError,
        TrainConfig,
        apply_override,
        config_from_dict,
        override_keys,
    )
    from minillm.errors import CheckpointError

    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if key.split(".", 1)[0] == "model":
            raise ConfigError(key, "the model is the checkpoint's (--ckpt)", "--set")
    if is_hf_folder(ckpt):
        if best:
            raise CheckpointError(
                f"{ckpt}: --best takes a run directory, not a Hugging Face folder"
            )
        model = hf_model_config(ckpt)  # config.json alone
        raw: dict[str, Any] = {
            "model": dataclasses.asdict(model),
            "data": {"vocab_size": model.vocab_size},
            "train": {
                "seq_len": min(TrainConfig.seq_len, model.max_seq_len),
                "init_from": str(ckpt),
            },
        }
        where, title, dtype = str(ckpt / "config.json"), str(ckpt), auto_dtype(ckpt)
    else:
        found = resolve_checkpoint(ckpt, verify=False, best=best)  # the config, not the weights
        state = read_state(found)
        check_model_config(found, state)  # state.json's model is the weights' own
        raw, where, title = state["config"], str(found / STATE_FILE), str(found)
        dtype = auto_dtype(found, state)
    for override in overrides:
        apply_override(raw, override)
    return config_from_dict(raw, file=where, overridden=override_keys(overrides)), title, dtype


def load_ckpt(
    ckpt: Path,
    device: str,
    best: bool = False,
    quantize: str = "none",
    context: list[str] | None = None,
    seq_len: int | None = None,
    dtype: str = "auto",
) -> Any:
    """--ckpt (with --best) loaded on --device (a user error: exit 2): a run, a checkpoint or a
    Hugging Face folder, which the command it is given to is first checked to suit; read at
    another context where `context` (--set) or eval's `seq_len` (--seq-len) asks (`at_context`);
    with --quantize int8 or nf4, its linear layers made so as they are read (int8 from float32
    weights, or one warning and fp32); otherwise in --dtype (`auto`: the weights' own)."""
    from minillm.checkpoint.layout import is_hf_folder
    from minillm.checkpoint.lazy import resolve_dtype
    from minillm.checkpoint.store import at_context, load_checkpoint
    from minillm.model.quantize import check_quantize
    from minillm.runtime.device import resolve_device

    quantize = run(check_quantize, quantize)  # before the (slow) load
    run(resolve_dtype, dtype, None)
    if quantize == "int8":
        if dtype not in ("auto", "float32"):
            run(_refuse, f"--dtype {dtype}: --quantize int8 quantizes float32 weights")
        dtype = "float32"
    if is_hf_folder(ckpt):
        run(_check_hf_folder_use, ckpt, _ckpt_command.get())
    where = run(resolve_device, device, "--device")
    # Quantized as it loads (nf4 on any device: bitsandbytes' CPU and CUDA kernels).
    loaded = run(load_checkpoint, ckpt, where, best=best, dtype=dtype, quantize=quantize)
    if context or seq_len is not None:
        loaded = run(at_context, loaded, context or [], seq_len)
    return loaded


def _refuse(message: str) -> None:
    from minillm.errors import UserError

    raise UserError(message)


def _check_hf_folder_use(folder: Path, ctx: typer.Context | None) -> None:
    """What the running command needs that a Hugging Face folder lacks, said before the (slow)
    load: `eval` without --data or --task would read the run's validation shards, and a folder
    has none; `chat` needs a chat template (the folder's, or minillm's own chat tokens)."""
    from minillm.errors import UserError

    if ctx is None:
        return
    command, params = ctx.command.name, ctx.params
    if command == "eval" and params.get("data") is None and not params.get("task"):
        raise UserError(
            f"{folder}: --data: a Hugging Face folder has no validation shards to evaluate; "
            "pass --data FILE (text or a dataset file) or --task FILE"
        )
    if command == "chat":
        from minillm.tokenizer.bpe import load_tokenizer
        from minillm.tokenizer.conventions import Conventions

        try:
            tok = load_tokenizer(folder / "tokenizer.json")
        except UserError:  # missing or unreadable: the load says so, naming the file
            return
        conv = Conventions.of(tok, folder)
        if conv.kind == "own" and not conv.has_chat:  # not a run: retraining is no advice
            raise UserError(
                f"{folder / 'tokenizer.json'}: no <|system|>, <|user|>, <|assistant|>, <|end|> "
                "and no chat template: `minillm chat` has no template to talk in; "
                "`minillm sample` continues text"
            )
        conv.check_chat(str(folder))
