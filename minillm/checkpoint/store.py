"""Checkpoints: atomic save, integrity-checked load, latest/best bookkeeping, loading a run.

Offers `save_checkpoint`, `find_latest`, `resolve_checkpoint`, `verify_checkpoint`,
`load_model_state`, `load_trainer_state`, `read_state`, `check_model_config` (state.json's
model config against the one stored with the weights), `load_checkpoint` (config + model +
tokenizer from a checkpoint alone, or from a Hugging Face folder: `is_hf_folder`; a LoRA run's
base + adapters, merged), `lora_base_of`, `load_weights_into` (from minillm.checkpoint.weights)
and `CheckpointError`.

Layout (docs/design.md, "Run directory and checkpoints"):
    <run>/checkpoints/step_000500/  model.safetensors, trainer_state.pt, tokenizer.json, state.json
    <run>/checkpoints/LATEST         name of the newest complete checkpoint
    <run>/checkpoints/BEST           name of the checkpoint with the lowest validation loss

A checkpoint is written into a hidden temporary folder, every file fsynced, then the folder is
renamed into place and only then LATEST is replaced (temp file + rename). A crash at any instant
therefore leaves the previous checkpoint whole and LATEST pointing at a complete one; state.json
records the sha256 of every file, so damage after the fact is detected at load time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minillm.checkpoint.weights import load_weights_into, weights_sha256
from minillm.errors import CheckpointError, UserError, warn
from minillm.runtime.files import (
    atomic_write_json,
    atomic_write_text,
    commit_dir,
    save_safetensors,
    sha256_file,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from minillm.config import Config

CKPT_DIR = "checkpoints"
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer_state.pt"
STATE_FILE = "state.json"
TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "config.json"  # a Hugging Face folder's (minillm.checkpoint.hf_folder)
FORMAT_VERSION = 1
CONFIG_KEY = "minillm.model_config"  # safetensors metadata: the model config, JSON
_STEP_RE = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    state: dict[str, Any],
    tokenizer_file: str | Path | None = None,
    keep_last: int = 3,
    is_best: bool = False,
) -> Path:
    """Write checkpoint `step` atomically, point LATEST (and BEST) at it, then prune old ones.

    `state` is the JSON-able summary (step, tokens, losses, config); file hashes are added here.
    """

    ckpt_root = Path(run_dir) / CKPT_DIR
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
        metadata = {"format": "pt", "step": str(step)}
        if isinstance(state.get("config"), dict) and "model" in state["config"]:
            # The architecture rides in the weights file, which state.json hashes: an edit of
            # state.json's model section no longer rebuilds a different forward unnoticed.
            metadata[CONFIG_KEY] = json.dumps(state["config"]["model"], sort_keys=True)
        save_safetensors(tensors, tmp / MODEL_FILE, metadata=metadata)
        torch.save(trainer_state, tmp / TRAINER_FILE)
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / TOKENIZER_FILE)
        files = sorted(p.name for p in tmp.iterdir())
        full_state = dict(state, step=step, version=FORMAT_VERSION, saved_at=time.time())
        full_state["files"] = {f: sha256_file(tmp / f) for f in files}
        atomic_write_json(tmp / STATE_FILE, full_state)
        # An existing `final` is a leftover from a run that crashed before LATEST named it.
        commit_dir(tmp, final)
        atomic_write_text(ckpt_root / "LATEST", name + "\n")
        if is_best:
            atomic_write_text(ckpt_root / "BEST", name + "\n")
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # a full disk, a quota, an I/O error: say so in one line
            raise CheckpointError(
                f"{ckpt_root}: writing checkpoint {name} failed ({e.strerror or e}); "
                f"LATEST still names the previous one, which is intact"
            ) from None
        raise
    prune_checkpoints(ckpt_root, keep_last)
    return final


def _read_pointer(ckpt_root: Path, pointer: str) -> str | None:
    try:
        return (ckpt_root / pointer).read_text().strip() or None
    except OSError:
        return None


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete-looking checkpoint folders (renamed into place), oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir() if (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def _step_of(path: Path) -> int:
    return int(_STEP_RE.match(path.name).group(1))


def prune_checkpoints(ckpt_root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints (not LATEST, BEST) and dead temp dirs."""
    keep = {_read_pointer(ckpt_root, "LATEST"), _read_pointer(ckpt_root, "BEST")}
    ckpts = list_checkpoints(ckpt_root)
    keep.update(p.name for p in ckpts[-keep_last:])
    for p in ckpts:
        if p.name not in keep:
            # Renamed out of sight first: a kill inside rmtree must not leave a half-deleted
            # folder under a checkpoint's name.
            trash = ckpt_root / f".trash-{p.name}-{os.getpid()}"
            os.rename(p, trash)
            shutil.rmtree(trash, ignore_errors=True)
    # Leftovers of dead processes: unfinished writes, half-deleted or replaced checkpoints.
    for p in [*ckpt_root.glob(".tmp-*"), *ckpt_root.glob(".trash-*"), *ckpt_root.glob(".*.old-*")]:
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_state(ckpt: str | Path) -> dict[str, Any]:
    path = Path(ckpt) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {ckpt} is not a minillm checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if not isinstance(state, dict) or "files" not in state or "config" not in state:
        raise CheckpointError(f"{path}: not a minillm checkpoint state (no files/config)")
    return state


def verify_checkpoint(ckpt: str | Path) -> dict[str, Any]:
    """state.json of `ckpt` after checking every recorded file's sha256; CheckpointError if not."""
    ckpt = Path(ckpt)
    state = read_state(ckpt)
    for name, digest in state["files"].items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        if sha256_file(path) != digest:
            raise CheckpointError(f"{path}: sha256 does not match state.json (damaged file)")
    return state


def find_latest(run_dir: str | Path, verify: bool = True) -> Path | None:
    """The checkpoint LATEST names (else the newest), or None if the run has none.

    If it fails its integrity check, older ones are tried in turn and a warning names the damaged
    checkpoint and the one used instead.
    """
    ckpt_root = Path(run_dir) / CKPT_DIR
    candidates = list_checkpoints(ckpt_root)
    latest = _read_pointer(ckpt_root, "LATEST")
    if latest in [p.name for p in candidates]:
        # LATEST decides; a folder newer than it is one whose LATEST update a crash cut short
        # (or one a user stepped back from), and will be replaced when that step is saved again.
        candidates = [p for p in candidates if _step_of(p) <= _step_of(ckpt_root / latest)]
    failures = []
    for candidate in reversed(candidates):
        try:
            verify_checkpoint(candidate) if verify else read_state(candidate)
        except CheckpointError as e:
            failures.append(f"{candidate.name} ({e})")
            continue
        if failures:
            warn(f"checkpoint {'; '.join(failures)} failed its integrity check; using {candidate}")
        return candidate
    if failures:
        raise CheckpointError(f"{ckpt_root}: no intact checkpoint: {'; '.join(failures)}")
    return None


POINTERS = ("LATEST", "BEST")
LOCK_FILE = "train.lock"  # the run lock's file (minillm.checkpoint.rundir.RunLock)


def resolve_checkpoint(path: str | Path, verify: bool = True, best: bool = False) -> Path:
    """The checkpoint for `--ckpt`: a run directory (its newest intact one, or with `best` the
    one BEST names), a checkpoint, or a run's checkpoints/LATEST or checkpoints/BEST file."""
    path = Path(path)
    if path.name == CKPT_DIR and path.is_dir() and not (path / STATE_FILE).exists():
        path = path.parent  # runs/x/checkpoints means the run
    if path.name in POINTERS and path.is_file():
        # A pointer file names a checkpoint folder next to it.
        if best:
            raise CheckpointError(f"{path}: --best takes a run directory, not a pointer file")
        name = _read_pointer(path.parent, path.name)
        if name is None or not (path.parent / name / STATE_FILE).is_file():
            raise CheckpointError(f"{path}: names {name!r}, which is not a checkpoint here")
        return resolve_checkpoint(path.parent / name, verify)
    if not path.exists():
        raise CheckpointError(f"{path}: no such run or checkpoint directory")
    if (path / STATE_FILE).is_file():
        if best:
            raise CheckpointError(f"{path}: --best takes a run directory, not a checkpoint")
        if verify:
            verify_checkpoint(path)
        return path
    if best:
        return _best_checkpoint(path, verify)
    if (path / CKPT_DIR).is_dir():
        found = find_latest(path, verify=verify)
        if found is not None:
            return found
    if (path / CKPT_DIR).is_dir() or (path / LOCK_FILE).exists() or (path / "config.yaml").exists():
        raise CheckpointError(f"{path}: no checkpoint yet{_training_note(path)}")
    raise CheckpointError(
        f"{path}: not a minillm run directory (no {CKPT_DIR}/) nor a checkpoint (no {STATE_FILE})"
        f" nor a Hugging Face model folder (no {HF_CONFIG_FILE})"
    )


def is_hf_folder(path: str | Path) -> bool:
    """Whether `--ckpt` names a Hugging Face model folder: a config.json, and neither a run's
    checkpoints/ nor a checkpoint's state.json (a minillm run or checkpoint is read as one)."""
    p = Path(path)
    return (
        (p / HF_CONFIG_FILE).is_file()
        and not (p / CKPT_DIR).is_dir()
        and not (p / STATE_FILE).is_file()
    )


def _best_checkpoint(run_dir: Path, verify: bool) -> Path:
    """The checkpoint BEST names in a run (the lowest validation loss so far)."""
    ckpt_root = run_dir / CKPT_DIR
    name = _read_pointer(ckpt_root, "BEST")
    if name is None:
        if list_checkpoints(ckpt_root):
            raise CheckpointError(
                f"{run_dir}: no best checkpoint yet (none saved after a validation); "
                "drop --best for the latest"
            )
        raise CheckpointError(f"{run_dir}: no checkpoint yet{_training_note(run_dir)}")
    # A damaged best checkpoint is no reason to stop: the newest intact one is a flag away.
    instead = "; or leave out --best to use the newest intact checkpoint"
    if not (ckpt_root / name / STATE_FILE).is_file():
        raise CheckpointError(
            f"{ckpt_root / 'BEST'}: names {name!r}, which is not a checkpoint{instead}"
        )
    if verify:
        try:
            verify_checkpoint(ckpt_root / name)
        except CheckpointError as e:
            raise CheckpointError(f"{e}{instead}") from None
    return ckpt_root / name


def _training_note(run_dir: Path) -> str:
    """`; a training holds its lock (pid N on host)` when a live `minillm train` holds the run."""
    import fcntl

    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return ""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # free: nobody trains this run now
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            return f"; a training holds its lock ({holder}): its first checkpoint is not written"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return ""
    finally:
        os.close(fd)


def load_model_state(
    ckpt: str | Path, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint (safetensors: no code runs while loading)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(ckpt) / MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def check_model_config(ckpt: str | Path, state: dict[str, Any]) -> None:
    """CheckpointError unless state.json's model config is the one stored with the weights.

    The weights file carries the model config in its metadata (since it has been written there);
    a checkpoint from before that carries none and is taken as it is.
    """
    from safetensors import SafetensorError, safe_open

    from minillm.config import ModelConfig

    path = Path(ckpt) / MODEL_FILE
    if not path.is_file():
        return  # load_model_state says so, with the weights
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = (f.metadata() or {}).get(CONFIG_KEY)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    if stored is None:
        return
    where = Path(ckpt) / STATE_FILE
    try:
        weights_cfg = json.loads(stored)
        assert isinstance(weights_cfg, dict)
    except (ValueError, AssertionError):
        raise CheckpointError(f"{path}: its model config metadata is not a JSON object") from None
    state_cfg = state.get("config", {}).get("model", {})
    keys = [f.name for f in dataclasses.fields(ModelConfig)]
    differ = [
        f"{k} {state_cfg.get(k)!r} here, {weights_cfg.get(k)!r} with the weights"
        for k in keys
        if state_cfg.get(k) != weights_cfg.get(k)
    ]
    if differ:
        raise CheckpointError(
            f"{where}: model.{'; model.'.join(differ)}: the config was edited after the "
            "checkpoint was saved; it must be the one the weights were trained with"
        )


def load_trainer_state(ckpt: str | Path) -> dict[str, Any]:
    """Optimizer, scaler and RNG state; `weights_only=True` refuses pickled code."""
    path = Path(ckpt) / TRAINER_FILE
    try:
        with warnings.catch_warnings():  # torch's note on a foreign pickle protocol: noise here
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as e:  # torch raises UnpicklingError and friends for unsafe or broken files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: refused or unreadable trainer state ({first})") from None


@dataclass
class LoadedCheckpoint:
    """Everything `eval`, `sample` and `export` need, rebuilt from a checkpoint alone."""

    path: Path
    config: Config
    model: torch.nn.Module
    tokenizer: Tokenizer
    state: dict[str, Any]
    hf_folder: bool = False  # a Hugging Face folder: no run, no validation shards, no state.json
    # A LoRA run's adapters as trained (`model` holds them merged into the base): for
    # `minillm export --format peft`. None for any other checkpoint.
    adapters: dict[str, torch.Tensor] | None = None


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu", verify: bool = True, best: bool = False
) -> LoadedCheckpoint:
    """Config, model (eval mode, fp32) and tokenizer from `--ckpt` (a run, a checkpoint or a
    Hugging Face Llama folder).

    A run directory gives its newest intact checkpoint (a damaged newer one is skipped with a
    warning naming both, as `train` resumes), `best` the one BEST names; a checkpoint folder
    named explicitly that fails its check is an error. Each file is hashed once, here. A Hugging
    Face folder is read by minillm.checkpoint.hf_folder, which refuses what minillm would not
    compute as transformers does (another architecture, RoPE scaling, another tokenizer kind).
    """
    from minillm.config import config_from_dict, config_to_dict
    from minillm.data.tokenizer import load_tokenizer
    from minillm.errors import ConfigError

    if is_hf_folder(path):
        from minillm.checkpoint.hf_folder import read_hf_checkpoint

        if best:
            raise CheckpointError(
                f"{path}: --best takes a run directory, not a Hugging Face folder"
            )
        cfg, weights, tokenizer = read_hf_checkpoint(path)
        model = _model_from(cfg, weights, str(path), device)
        state = {"config": config_to_dict(cfg)}
        return LoadedCheckpoint(Path(path), cfg, model, tokenizer, state, hf_folder=True)
    ckpt = resolve_checkpoint(path, verify=verify, best=best)
    state = read_state(ckpt)
    check_model_config(ckpt, state)
    try:
        cfg = config_from_dict(state["config"], file=str(ckpt / STATE_FILE))
    except ConfigError as e:
        raise CheckpointError(f"{ckpt / STATE_FILE}: its config is invalid: {e}") from None
    adapters = None
    if lora_base_of(state) is not None:
        model, adapters = _lora_model(cfg, state, ckpt, device)
    else:
        model = _model_from(cfg, load_model_state(ckpt), str(ckpt / MODEL_FILE), device)
    tok_path = ckpt / TOKENIZER_FILE
    if not tok_path.is_file():
        tok_path = ckpt.parent.parent / TOKENIZER_FILE
    try:
        tokenizer = load_tokenizer(tok_path)  # literal "<|endoftext|>" in text stays text
    except UserError as e:
        raise CheckpointError(f"{tok_path}: cannot load the run's tokenizer ({e})") from None
    _check_vocab(tokenizer, cfg, tok_path)
    return LoadedCheckpoint(ckpt, cfg, model, tokenizer, state, adapters=adapters)


# ------------------------------------------------------------------ LoRA runs


def lora_base_of(state: dict[str, Any]) -> dict[str, str] | None:
    """The base identity a LoRA run's checkpoint records in state.json (`lora_base`: path,
    source, abspath, sha256, minillm.checkpoint.init_from.lora_base); None for other runs."""
    base = state.get("lora_base")
    return base if isinstance(base, dict) and "sha256" in base else None


def _lora_model(
    cfg: Config, state: dict[str, Any], ckpt: Path, device: str | torch.device
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A LoRA checkpoint's model: its recorded base (loaded as any --ckpt is, checked against
    the recorded sha256) with the checkpoint's adapters merged in, and the adapters."""
    from minillm.model.lora import add_lora, is_adapter, merge_lora

    base = lora_base_of(state)
    where = ckpt / STATE_FILE
    tried = dict.fromkeys([base["source"], base.get("abspath", ""), base.get("path", "")])
    folder = next((Path(p) for p in tried if p and Path(p).exists()), None)
    if folder is None:
        raise CheckpointError(
            f"{where}: the LoRA base {base['source']} is missing (train.init_from "
            f"{base.get('path')!r}); the adapters need the weights they were trained on"
        )
    try:
        model = load_checkpoint(folder, device="cpu").model
    except UserError as e:
        raise CheckpointError(f"{where}: the LoRA base {folder} does not load: {e}") from None
    if weights_sha256(model.state_dict()) != base["sha256"]:
        raise CheckpointError(
            f"{folder}: the LoRA base of {ckpt} has changed since the adapters were trained "
            f"(the sha256 of its weights is not the recorded {base['sha256'][:16]}...)"
        )
    if getattr(model, "cfg", None) != cfg.model:
        raise CheckpointError(f"{folder}: the LoRA base's model is not {where}'s model section")
    add_lora(model, cfg.train.lora)
    adapters = load_model_state(ckpt)
    frozen = {k: v for k, v in model.state_dict().items() if not is_adapter(k)}
    load_weights_into(model, {**frozen, **adapters}, str(ckpt / MODEL_FILE))
    return merge_lora(model).to(device).eval(), adapters


def _model_from(
    cfg: Config, weights: dict[str, torch.Tensor], where: str, device: str | torch.device
) -> torch.nn.Module:
    """The Transformer of `cfg` holding `weights`, on `device`, in eval mode."""
    from minillm.model import Transformer

    model = Transformer(cfg.model)
    load_weights_into(model, weights, where)
    return model.to(device).eval()


def _check_vocab(tokenizer: Tokenizer, cfg: Config, tok_path: Path) -> None:
    if tokenizer.get_vocab_size() > cfg.model.vocab_size:
        raise CheckpointError(
            f"{tok_path}: tokenizer has {tokenizer.get_vocab_size()} tokens, more than "
            f"model.vocab_size={cfg.model.vocab_size}"
        )
