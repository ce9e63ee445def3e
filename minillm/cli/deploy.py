"""The commands that hand a checkpoint to other programs: `minillm serve` (an OpenAI-compatible
HTTP server) and `minillm export` (a Hugging Face folder or a GGUF file)."""

from __future__ import annotations

from pathlib import Path

import typer

from minillm.cli.command import Command, print_error, run
from minillm.cli.options import BestOption, CkptChoice, CkptOption, ckpt_options, load_ckpt
from minillm.cli.root import app


@app.command(
    cls=Command, short_help="An OpenAI-compatible HTTP server with a chat page (several users)."
)
@ckpt_options
def serve(
    ckpt: CkptChoice,
    host: str = typer.Option(
        "127.0.0.1", "--host", metavar="HOST", help="Address to listen on (0.0.0.0: every one)."
    ),
    port: int = typer.Option(8000, "--port", metavar="PORT", help="Port; 0 picks a free one."),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        metavar="KEY",
        envvar="MINILLM_API_KEY",
        show_envvar=True,
        help="Require `Authorization: Bearer KEY` on every endpoint but /health and the page.",
    ),
    max_batch: int = typer.Option(
        16, "--max-batch", metavar="N", help="Most requests (rows) decoded at once."
    ),
    max_queue: int = typer.Option(
        64, "--max-queue", metavar="N", help="Most rows waiting for a slot; past it: 429."
    ),
) -> None:
    """Serve a checkpoint over OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models)
    with continuous batching, and a chat page at /. The model's name is the run's name.
    """
    try:
        from minillm.serve.server import bind
        from minillm.serve.server import serve as run_server
    except ImportError as e:
        print_error(f"minillm serve needs FastAPI and uvicorn ({e}): pip install 'minillm[serve]'")
        raise typer.Exit(2) from None

    sock = run(bind, host, port)  # a busy port is one line now, not after the model loads
    loaded = ckpt.load()
    name = loaded.path.parent.parent.name if loaded.path.parent.name == "checkpoints" else None
    run(
        run_server,
        loaded,
        name or loaded.path.name,
        host=host,
        port=port,
        api_key=api_key or None,
        max_batch=max_batch,
        max_queue=max_queue,
        sock=sock,
    )


@app.command(
    cls=Command,
    short_help="Write a Hugging Face Llama folder, a GGUF file or peft adapters.",
)
def export(
    ckpt: Path = CkptOption,
    best: bool = BestOption,
    out: Path = typer.Option(
        ..., "--out", metavar="PATH", help="The folder (hf, peft) or FILE.gguf (gguf) to write."
    ),
    force: bool = typer.Option(False, "--force", help="Replace an earlier export at --out."),
    fmt: str = typer.Option(
        "hf",
        "--format",
        metavar="FORMAT",
        help="hf: a transformers folder; gguf: one file for llama.cpp, Ollama, LM Studio; "
        "peft: a LoRA run's adapters for Hugging Face peft (hf and gguf merge them).",
    ),
    dtype: str | None = typer.Option(
        None,
        "--dtype",
        metavar="DTYPE",
        help="gguf only: f32 (default, exact), f16 or q8_0 (2-D weights; norms stay f32).",
    ),
    max_shard_size: str | None = typer.Option(
        None,
        "--max-shard-size",
        metavar="SIZE",
        help="hf only: the largest weights file, e.g. 5GB (default), 500MB, 2GiB; past it the "
        "weights are shards with an index, as transformers' save_pretrained writes them.",
    ),
) -> None:
    """Write a Hugging Face folder of the model's class (config, safetensors weights in the
    model's dtype, sharded past --max-shard-size, tokenizer), or with --format gguf a llama.cpp
    GGUF file and an Ollama FILE.Modelfile beside it.

    The folder loads with transformers' AutoModelForCausalLM and AutoTokenizer.from_pretrained.
    A LoRA run exports merged (base + adapters); with --format peft its adapters alone, as a
    folder that peft.PeftModel.from_pretrained puts on the hf export of its base.
    """
    if fmt not in ("hf", "gguf", "peft"):
        print_error(f"--format: {fmt!r} is not one of hf, gguf, peft")
        raise typer.Exit(2)
    if max_shard_size is not None and fmt != "hf":
        print_error(f"--max-shard-size: only with --format hf (not {fmt})")
        raise typer.Exit(2)
    if fmt == "gguf":
        from minillm.checkpoint.gguf_file import check_gguf_target, export_gguf, modelfile_path

        run(check_gguf_target, out, force, ckpt, dtype or "f32")  # before the (slow) load
        loaded = load_ckpt(ckpt, "cpu", best)
        path = run(export_gguf, loaded, out, dtype or "f32", force=force)
        print(f"wrote {path} and {modelfile_path(path).name}")
        return
    if dtype is not None:
        kept = "an hf folder keeps the model's dtype" if fmt == "hf" else "adapters are float32"
        print_error(f"--dtype: only with --format gguf ({kept})")
        raise typer.Exit(2)
    if fmt == "peft":
        from minillm.checkpoint.hf_export import check_export_target
        from minillm.checkpoint.peft_folder import export_peft

        run(check_export_target, out, force, ckpt)  # before the (slow) load
        loaded = load_ckpt(ckpt, "cpu", best)
        path = run(export_peft, loaded, out, force=force)
        print(f"wrote {path}")
        return
    from minillm.checkpoint.hf_export import check_export_target, export_checkpoint
    from minillm.checkpoint.hf_shards import DEFAULT_MAX_SHARD_SIZE, parse_size

    shard_bytes = run(parse_size, max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    run(check_export_target, out, force, ckpt)  # before the (slow) load
    loaded = load_ckpt(ckpt, "cpu", best)
    path = run(export_checkpoint, loaded, out, force=force, max_shard_size=shard_bytes)
    print(f"wrote {path}")
