"""Published models by their Hugging Face Hub name: `--ckpt org/name`, `train.init_from: org/name`.

Offers `resolve_model_path(value)`: the local folder a `--ckpt` or `train.init_from` value
names. A path that exists is itself (a local folder of that name wins); a hub id
(`minillm.config.hub_id.is_hub_id`) is fetched with huggingface_hub's `snapshot_download` into its
cache and the snapshot folder returned; anything else is returned as given, for the caller's
own "no such folder" error.

Only what minillm reads is fetched (`ALLOW`): config.json, generation_config.json, the tokenizer
files and the safetensors weights at the repository's top level, never a second copy of the
weights in another format (Mistral's `consolidated.safetensors`, `original/`). huggingface_hub
does the rest as transformers has it: its progress bar, `HF_TOKEN` (or `huggingface-cli login`)
for gated models, `HF_HUB_OFFLINE=1` (the cache alone) and `HF_HUB_CACHE` / `HF_HOME` (where the
cache is). A name it cannot get is one line naming it and why.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from minillm.config.hub_id import is_hub_id
from minillm.errors import UserError

CONFIG_FILES = ["config.json", "generation_config.json"]
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
]
WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json"]
ALLOW = CONFIG_FILES + TOKENIZER_FILES + WEIGHT_FILES
# fnmatch's * crosses "/": the top level only, and not Mistral's consolidated copy of the weights.
IGNORE = ["*/*", "consolidated*"]


def resolve_model_path(value: str | Path, weights: bool = True) -> Path:
    """The local folder `value` names: itself if it exists (or is not a hub id), else the hub
    snapshot of that id (downloaded unless cached; `weights=False`: config and tokenizer only,
    for `minillm info`). A UserError names the id when the hub cannot give it."""
    path = Path(value)
    if path.exists() or not is_hub_id(str(value)):
        return path
    return _snapshot(str(value), weights)


@functools.cache
def _snapshot(repo_id: str, weights: bool) -> Path:
    """snapshot_download once per process (a run resolves init_from in several places)."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub import errors as hub_errors
    except ImportError:  # a runtime dependency; a broken install still gets one line
        raise UserError(
            f"{repo_id}: no such folder here, and huggingface_hub is not installed to fetch it "
            "from the Hugging Face Hub (pip install huggingface_hub)"
        ) from None
    allow = ALLOW if weights else CONFIG_FILES + TOKENIZER_FILES
    where = f"no such folder here, and the Hugging Face Hub has no {repo_id!r}"
    # Read from the environment now, not from huggingface_hub's constants, which are fixed when
    # it is first imported (transformers may have imported it before the variables were set).
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    try:
        folder = snapshot_download(repo_id, allow_patterns=allow, ignore_patterns=IGNORE,
                                   cache_dir=cache, local_files_only=offline)  # fmt: skip
        return Path(folder)
    except hub_errors.GatedRepoError:
        raise UserError(
            f"{repo_id}: a gated model: accept its terms on huggingface.co and set HF_TOKEN "
            "(or `hf auth login`)"
        ) from None
    except hub_errors.RepositoryNotFoundError:
        raise UserError(f"{repo_id}: {where} (a private one needs HF_TOKEN)") from None
    except hub_errors.RevisionNotFoundError:
        raise UserError(f"{repo_id}: {where} at its main revision") from None
    except hub_errors.LocalEntryNotFoundError:
        if offline:
            raise UserError(
                f"{repo_id}: no such folder here, and not in the Hugging Face cache {cache} "
                "(HF_HUB_OFFLINE=1: nothing is downloaded)"
            ) from None
        raise UserError(
            f"{repo_id}: no such folder here, the Hugging Face Hub could not be reached and "
            f"the cache {cache} has no copy"
        ) from None
    except (hub_errors.HfHubHTTPError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        why = f"fetching it from the Hugging Face Hub failed: {first}"
        raise UserError(f"{repo_id}: {why}") from None
