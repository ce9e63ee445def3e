"""Where `minillm tokenize` writes while it runs: numbered shards, checkpoints, the commit.

Offers `Staging` (the folder `<out_dir>/.partial/` with its state.json), `pass_inputs` (what a
resumed pass must find unchanged), `resume_writers`, `make_meta`, `commit` (the shards into place,
meta.json last), `up_to_date` (whether the shards in place are what a pass would write again) and
`CHECKPOINT_BYTES`. The shard files themselves are written by
minillm.data.shard_writer's `ShardWriter`, one per split (and one per split's mask).

Why: a pass over tens of GB must survive Ctrl-C or kill -9. Every `CHECKPOINT_BYTES` of text the
writer drains its encoders, fsyncs the shard being written and records in state.json how many
documents are done and how many tokens each shard holds. A rerun with the same inputs truncates
the open shard to its recorded length, skips the documents already done and continues; since a
piece of text encodes to the same ids whatever batch it is in, the result is byte-identical to an
uninterrupted run. A rerun with other inputs is refused, naming the key that changed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from minillm.config import DataConfig
from minillm.data.meta import MASK_SUFFIX, META_VERSION, SPLITS, data_record, sibling_name
from minillm.data.shard_writer import ShardWriter
from minillm.errors import ConfigError, warn
from minillm.runtime.files import atomic_copy, atomic_write_json, atomic_write_text, fsync_dir

CHECKPOINT_BYTES = 64 << 20  # text between checkpoints: ~15 s of encoding at 4 MB/s
STATE_VERSION = 1
# Inputs added since STATE_VERSION 1: a checkpoint without them was made with these values.
_ADDED_INPUTS = {
    "data.max_documents": 0,
    "data.max_bytes": 0,
    "data.val_documents": 0,
    "data.decode_errors": "strict",
}


class Staging:
    """`<out_dir>/.partial/`: the shards (and a newly trained tokenizer.json) of a run in
    progress, and state.json, its last checkpoint."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / ".partial"
        self.state_path = self.path / "state.json"

    def load(self) -> dict[str, Any] | None:
        """The last checkpoint, or None (no interrupted run, or one unreadable: start over)."""
        try:
            state = json.loads(self.state_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        ok = isinstance(state, dict) and state.get("version") == STATE_VERSION
        return state if ok else None

    def check_inputs(self, state: dict[str, Any], inputs: dict[str, Any], label: str) -> None:
        """Refuse to resume with inputs other than the interrupted run's, naming the first key
        that changed (data.source last: its fingerprint also follows the split settings)."""
        was = state.get("inputs", {})
        for key in sorted(inputs, key=lambda k: k == "data.source"):
            if was.get(key, _ADDED_INPUTS.get(key)) != inputs[key]:
                raise ConfigError(
                    key,
                    f"changed since the interrupted `minillm tokenize` whose checkpoint is in "
                    f"{self.path} (was {_short(was.get(key))}, now {_short(inputs[key])}); put "
                    "it back to resume, or pass --retrain (or delete that folder) to start over",
                    label,
                )

    def start(self) -> None:
        """An empty staging folder (an old one's contents are gone)."""
        self.remove()
        self.path.mkdir(parents=True)

    def save(self, state: dict[str, Any]) -> None:
        atomic_write_json(self.state_path, {"version": STATE_VERSION, **state})

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self.path.parent.exists():
            fsync_dir(self.path.parent)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _install(src: Path, dst: Path) -> None:
    """Move a finished shard from the staging folder into data.out_dir (a rename, same disk)."""
    os.replace(src, dst)


def commit(staging: Staging, out_dir: Path, tok_path: Path | None, meta: dict[str, Any]) -> None:
    """Move the staged shards (and a new tokenizer) into place, meta.json last.

    From the unlink until the new meta.json lands no meta.json exists, so no reader can pair the
    old token counts with new shards. Old shards are removed first: those of version 1
    (train.bin) and numbered ones a bigger corpus left.
    """
    meta_path = out_dir / "meta.json"
    meta_path.unlink(missing_ok=True)
    if tok_path is not None:
        atomic_copy(staging.path / "tokenizer.json", tok_path)
    for s in SPLITS:
        old = [out_dir / f"{s}.bin", out_dir / f"{s}{MASK_SUFFIX}"]
        old += [*out_dir.glob(f"{s}_[0-9]*.bin"), *out_dir.glob(f"{s}_[0-9]*{MASK_SUFFIX}")]
        for path in old:
            path.unlink(missing_ok=True)
    for s in SPLITS:
        for sh in meta[s]["shards"]:
            _install(staging.path / sh["file"], out_dir / sh["file"])
            if "mask_sha256" in sh:
                mask = sibling_name(sh["file"])
                _install(staging.path / mask, out_dir / mask)
    fsync_dir(out_dir)
    atomic_write_text(meta_path, json.dumps(meta, indent=2) + "\n")
    staging.remove()


def pass_inputs(data: DataConfig, fingerprint: str, tokenizer: str) -> dict[str, Any]:
    """What the shards are made from: a resumed pass must see the same (Staging.check_inputs)."""
    record = data_record(data)
    inputs: dict[str, Any] = {f"data.{k}": v for k, v in record.items() if k != "source"}
    inputs["data.vocab_size"], inputs["data.shard_tokens"] = data.vocab_size, data.shard_tokens
    inputs["data.tokenizer_sample_bytes"] = data.tokenizer_sample_bytes
    inputs["data.tokenizer"] = tokenizer
    inputs["data.source"] = f"{record['source']} (fingerprint {fingerprint[:12]})"
    return inputs


def shard_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """What meta.json records as its "inputs": a pass's inputs but the tokenizer, whose identity
    is meta.json's tokenizer_sha256 (pass_inputs names a trained one by its path alone)."""
    return {k: v for k, v in inputs.items() if k != "data.tokenizer"}


def up_to_date(out_dir: Path, inputs: dict[str, Any], tok_sha: str, eot_id: int) -> bool:
    """Whether the shards in `out_dir` are what a pass with these inputs would write again:
    meta.json records the same inputs (every data key that shapes the shards, and the source
    files' fingerprint: their paths, sizes and mtimes), the same tokenizer (its sha256) and
    end-of-text id, and every shard it lists is there at its recorded size. Shards from before
    meta.json recorded its inputs are not (a pass writes them again, once)."""
    try:
        meta = json.loads((out_dir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or meta.get("version") != META_VERSION:
        return False
    same = (meta.get("inputs"), meta.get("tokenizer_sha256"), meta.get("eot_id"))
    if same != (shard_inputs(inputs), tok_sha, eot_id):
        return False
    try:
        for s in SPLITS:
            for sh in meta[s]["shards"]:
                if (out_dir / sh["file"]).stat().st_size != sh["file_bytes"]:
                    return False
                if "mask_sha256" in sh:
                    mask = out_dir / sibling_name(sh["file"])
                    if mask.stat().st_size != sh["tokens"]:  # one byte a token
                        return False
    except (OSError, KeyError, TypeError):
        return False
    return True


def resume_writers(
    state: dict[str, Any] | None, writers: dict[str, ShardWriter], staging: Staging
) -> dict[str, Any] | None:
    """The checkpoint to continue from with `writers` positioned there, or None: start over."""
    if state is None or state.get("stats") is None:
        return None
    try:
        for name, w in writers.items():
            w.resume(state["writers"][name])
    except (KeyError, OSError):  # a shard gone or short (say, a crash while committing)
        for w in writers.values():
            w.discard()
            w.shards, w.current = [], 0
        warn(f"{staging.path}: the checkpoint's shards are incomplete; starting the pass over")
        return None
    return state


def make_meta(
    data: DataConfig,
    fingerprint: str,
    ids: tuple[int, int, str],
    stats: dict[str, dict[str, Any]],
    writers: dict[str, ShardWriter],
    masks: dict[str, ShardWriter] | None,
) -> dict[str, Any]:
    """meta.json's shard and count keys (the format is described in minillm.data.meta); ids:
    (vocab_size, eot_id, dtype). The caller adds chat, loss_on and tokenizer_sha256."""
    vocab, eot, dtype = ids
    meta: dict[str, Any] = {"version": META_VERSION, "dtype": dtype}
    meta["vocab_size"], meta["eot_id"], meta["shard_tokens"] = vocab, eot, data.shard_tokens
    for s in SPLITS:
        shards = [dict(sh) for sh in writers[s].shards]
        if masks:
            for sh, mask in zip(shards, masks[s].shards, strict=True):
                sh["mask_sha256"] = mask["sha256"]
        meta[s] = {
            "tokens": writers[s].tokens,
            "bytes": stats[s]["bytes"],
            "documents": stats[s]["documents"],
            "targets": stats[s].get("targets", writers[s].tokens),
            "target_bytes": stats[s].get("target_bytes", stats[s]["bytes"]),
            "replaced_documents": stats[s]["replaced"],
            "skipped_documents": stats[s]["skipped"],
            "shards": shards,
        }
    meta["source_fingerprint"] = fingerprint
    meta["data"] = data_record(data)
    return meta
