"""Published models' folders for the tests, built by scripts/make_published_folder.py (a
random-weight transformers model and a byte-level BPE that carries a family's real special
tokens, post-processor, chat template, tokenizer_config.json and generation_config.json).

`family_folder(root, name)` writes one (weights spread wide); `hf_tokenizer(folder)` is
transformers' AutoTokenizer of it; `CONVERSATIONS` are the conversations the tests render.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any

import transformers

from tests.helpers import ROOT, spread_weights_


def _script() -> Any:
    name = "make_published_folder"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


FAMILIES: dict[str, dict[str, Any]] = _script().FAMILIES
VOCAB = 400
# The transformers class of a family's folder where it is not a Llama.
MODEL_CLASSES = {"gemma3": "Gemma3ForCausalLM", "deepseek-v3": "DeepseekV3ForCausalLM"}


@functools.lru_cache(maxsize=8)
def _tokenizer_json(name: str, split: str = "gpt2", without: tuple[int, ...] = ()) -> str:
    return _script().tokenizer_json(name, VOCAB, 8000, split, without)


def family_tokenizer(name: str, split: str = "gpt2", without: tuple[int, ...] = ()) -> Any:
    """Family `name`'s tokenizer, splitting text as `split` (make_published_folder.SPLITS), its
    vocabulary without the tokens of the bytes `without`."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json(name, split, without))


def family_folder(
    root: Path,
    name: str,
    model_class: str | None = None,
    split: str = "gpt2",
    without: tuple[int, ...] = (),
    **config: Any,
) -> Path:
    """A published model's folder of family `name` (the family's own model class, or a Llama
    unless `model_class` says; its tokenizer family_tokenizer(name, split, without)), its random
    weights spread wide (norms off their init)."""
    import torch

    default = MODEL_CLASSES.get(name, "LlamaForCausalLM")
    model_class = model_class or FAMILIES[name].get("model", (default,))[0]
    tokenizer = _tokenizer_json(name, split, without)
    folder = _script().build(root / name, name, tokenizer, model_class, **config)
    # Spread the weights as the other parity tests do: init's ones and zeros hide mistakes.
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(3)
    spread_weights_(model)
    model.save_pretrained(folder)
    return folder


def hf_tokenizer(folder: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(folder))


CONVERSATIONS = [
    [{"role": "user", "content": "Who art thou?"}],
    [
        {"role": "system", "content": "Speak as a herald."},
        {"role": "user", "content": "What news?"},
        {"role": "assistant", "content": "The king is come to Köln 🙂"},
        {"role": "user", "content": "  And then?  "},
        {"role": "assistant", "content": "He sleeps.\nGood night."},
    ],
    [
        {"role": "user", "content": "Speak."},
        {"role": "assistant", "content": "I will."},
    ],
]


# The model families (FAMILIES with a `model`): the end-to-end CLI tests run each.
MODEL_FAMILIES = [name for name, family in FAMILIES.items() if "model" in family]


def usable(name: str, messages: list[dict[str, str]]) -> bool:
    """Mistral's [INST] template has no system role."""
    return not (name.startswith("mistral") and messages[0]["role"] == "system")
