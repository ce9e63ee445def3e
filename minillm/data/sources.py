"""Where the documents come from: `data.source` resolved to files or a hub dataset, and opened.

Offers `open_corpus(data_cfg) -> Corpus` (minillm.data.corpus) and `EXTENSIONS`.

`data.source` is a file, a glob (`data/*.txt`, `**` recurses), a folder (searched recursively,
hidden files skipped) or a Hugging Face hub dataset name. A hub name is tried only when the source
does not look like a path: it does not exist, has no glob characters and no file extension, is
`name` or `owner/name` (no leading `/`, `.` or `~`, no deeper folders), and `owner` is not a local
folder. With `data.format: auto` the format comes from the extension: .txt, .text, .md are text;
.json, .jsonl are json; .parquet; .csv. A folder keeps only those files. Rows are loaded with
`datasets.load_dataset`, or streamed with `data.streaming`.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Any

from minillm.config import DataConfig
from minillm.config.loading import in_current_folder
from minillm.data.corpus import Corpus, TextCorpus, error_reason, first_line
from minillm.data.jsonl_check import jsonl_problem
from minillm.data.table import TableCorpus
from minillm.errors import ConfigError


def _fail(file: str | Path | None, key: str, message: str) -> ConfigError:
    return ConfigError(key, message, str(file) if file is not None else None)


EXTENSIONS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _looks_like_hub(source: str) -> bool:
    if not _HUB_NAME.match(source) or Path(source).suffix:
        return False
    owner = source.split("/")[0]
    return "/" not in source or not Path(owner).is_dir()


def _resolve_files(source: str, fmt: str) -> list[Path] | None:
    """The files a source names, sorted; None when it is a hub dataset name."""
    if any(c in source for c in "*?["):
        files = sorted(
            Path(m)
            for m in glob.glob(os.path.expanduser(source), recursive=True)
            if os.path.isfile(m)
        )
        if not files:
            raise _fail(
                source, "data.source", f"no files match this pattern{in_current_folder(source)}"
            )
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            files = sorted(
                f
                for f in path.rglob("*")
                if f.is_file() and not any(p.startswith(".") for p in f.relative_to(path).parts)
            )
            others = files
            if fmt == "auto":
                files = [f for f in files if f.suffix.lower() in EXTENSIONS]
            if not files:
                kinds = ", ".join(EXTENSIONS)
                message = f"no data files in this folder ({kinds})"
                if others:  # e.g. source code: text under another extension, as the glob says
                    suffixes = sorted({f.suffix or "(none)" for f in others})
                    shown = ", ".join(suffixes[:5]) + (" ..." if len(suffixes) > 5 else "")
                    message += (
                        f"; its {len(others)} other files ({shown}) are read as text with "
                        "data.format: text"
                    )
                raise _fail(source, "data.source", message)
        elif path.exists():
            files = [path]
        elif _looks_like_hub(source):
            return None
        else:
            raise _fail(source, "data.source", f"no such file or folder{in_current_folder(source)}")
    for f in files:
        try:
            open(f, "rb").close()
        except OSError as e:
            raise _fail(f, "data.source", f"cannot read: {e.strerror or e}") from None
    return files


def _format_of(files: list[Path], fmt: str, source: str) -> str:
    if fmt != "auto":
        return fmt
    kinds = set()
    for f in files:
        kind = EXTENSIONS.get(f.suffix.lower())
        if kind is None:
            what = f"'{f.suffix}' files" if f.suffix else "files without an extension"
            raise _fail(
                f,
                "data.format",
                f"cannot tell the format of {what}; set text, json, parquet or csv",
            )
        kinds.add(kind)
    if len(kinds) > 1:
        raise _fail(
            source, "data.format", f"mixed formats ({', '.join(sorted(kinds))}); use one kind"
        )
    return kinds.pop()


def _quiet_datasets() -> None:
    import datasets
    import huggingface_hub

    datasets.disable_progress_bars()
    # CRITICAL, not ERROR: the loaders log "Failed to load JSON from file ..." before raising,
    # and the error line below already carries their reason.
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    huggingface_hub.utils.logging.set_verbosity_error()  # no "Retrying in 1s" lines offline


def _load_files(fmt: str, files: list[Path], data: DataConfig) -> Any:
    """A `datasets.Dataset` (converted to the arrow cache), or with `streaming` an
    `IterableDataset` (nothing converted; a file that fails to parse fails when read)."""
    import datasets

    _quiet_datasets()
    data_files = [str(f) for f in files]
    streaming, source = data.streaming, data.source
    try:
        return datasets.load_dataset(fmt, data_files=data_files, split="train", streaming=streaming)
    except Exception as e:  # datasets/pyarrow raise many types for unparsable files
        # jsonl: the line at fault, counted from 1 (arrow's "row N" is 0-based within a block).
        if fmt == "json" and (problem := jsonl_problem(files, data.text_field)) is not None:
            raise problem from None
        where = files[0] if len(files) == 1 else source
        e = error_reason(e)
        raise _fail(where, "data.source", f"cannot read as {fmt}: {first_line(e)}") from None


def _load_hub(name: str, streaming: bool) -> Any:
    import datasets

    _quiet_datasets()
    try:
        return datasets.load_dataset(name, split="train", streaming=streaming)
    except ConnectionError:
        raise _fail(
            name,
            "data.source",
            "not a local file or folder, and the Hugging Face hub is unreachable to look it up",
        ) from None
    except Exception as e:
        raise _fail(
            name, "data.source", f"not a local file or folder, nor a hub dataset: {first_line(e)}"
        ) from None


def hub_revision(name: str) -> str:
    """The commit sha of a hub dataset's main revision, what its shards are made from, or ""
    when the hub cannot say (offline, reading a cached copy)."""
    try:
        import huggingface_hub

        return huggingface_hub.HfApi().dataset_info(name, timeout=30).sha or ""
    except Exception:
        return ""


def open_corpus(data: DataConfig) -> Corpus:
    """Resolve `data.source` and open it; every problem is a UserError naming the file and key."""
    files = _resolve_files(data.source, data.format)
    fmt = "hub" if files is None else _format_of(files, data.format, data.source)
    if fmt == "text":
        assert files is not None
        return TextCorpus(files, data)
    if data.streaming and not data.val_documents:
        raise _fail(
            data.source,
            "data.val_documents",
            "must be > 0 with data.streaming: a stream's length is unknown until read, so "
            "data.val_fraction's random split cannot be drawn; set the documents that go to "
            "validation (the first ones)",
        )
    if files is None:
        ds = _load_hub(data.source, data.streaming)
        return TableCorpus(ds, [], "hub", data, data.source, hub_revision(data.source))
    label = str(files[0]) if len(files) == 1 else data.source
    ds = _load_files(fmt, files, data)
    return TableCorpus(ds, files, fmt, data, label)
