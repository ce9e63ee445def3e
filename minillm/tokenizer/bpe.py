"""The byte-level BPE tokenizer (Hugging Face `tokenizers`): train, save, load, check.

Offers `EOT`, `SPECIAL_TOKENS`, `MIN_VOCAB`, `new_tokenizer`, `train_tokenizer`, `save_tokenizer`,
`load_tokenizer`, `check_tokenizer`, `byte_alphabet` (GPT-2's character for each byte),
`check_vocab_size`, `check_not_a_models_tokenizer` (a file that `--retrain` must not replace),
`special_tokens`, `eot_id`, `CHAT_TOKENS` and `LEGACY_SPECIAL_TOKENS`.

The tokenizer is GPT-2's recipe: text is split by the byte-level regex (no prefix space), every
byte is in the base alphabet, and merges are learned on top. So any string, whatever its script,
emoji or whitespace, encodes without an unknown token and decodes back byte for byte.

`EOT` (`<|endoftext|>`) separates documents in the token shards; the chat tokens `<|system|>`,
`<|user|>`, `<|assistant|>` and `<|end|>` (end of a turn, minillm.tokenizer.chat_template) are
reserved by every tokenizer trained here, so a pretraining run's tokenizer can be fine-tuned on chat
as it is. Special tokens are only ever inserted by id. Tokenizers returned here encode their literal
text (`<|endoftext|>`, `<|user|>`, ...) as ordinary text (`encode_special_tokens = True`), so a
document that quotes one cannot fake a boundary or a turn and still round-trips. (That flag is not
stored in tokenizer.json.) Tokenizers from before the chat tokens (only `<|endoftext|>`) still load;
chat data and `minillm chat` refuse them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from minillm.errors import ConfigError, UserError
from minillm.runtime.files import atomic_write_text

EOT = "<|endoftext|>"
CHAT_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS: tuple[str, ...] = (EOT, *CHAT_TOKENS)
LEGACY_SPECIAL_TOKENS: tuple[str, ...] = (EOT,)  # tokenizers made before the chat tokens
# Every byte is a token of its own, so the vocabulary can't be smaller than this.
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE with GPT-2's pre-tokenization and decoder."""
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a document's first word is not given a space it did not have.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def check_vocab_size(vocab_size: int) -> None:
    """The vocabulary must hold every byte plus the special tokens."""
    if vocab_size < MIN_VOCAB:
        raise ConfigError(
            "data.vocab_size",
            f"{vocab_size} is too small: the 256 byte tokens plus {len(SPECIAL_TOKENS)} special "
            f"token(s) need at least {MIN_VOCAB}",
        )


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 0) -> Tokenizer:
    """Learn a byte-level BPE with exactly `vocab_size` tokens (specials included) from `texts`.

    `texts` may be cut anywhere the byte-level regex would split anyway (see minillm.data.corpus):
    word counts, hence merges, are the same as for the uncut documents. A corpus too small to
    support `vocab_size` distinct tokens is a UserError naming `data.vocab_size`, because a
    tokenizer smaller than the config asks for would be rejected the next time it is reused.
    """
    check_vocab_size(vocab_size)
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # the caller wraps `texts` in its own progress bar
    )
    tok.train_from_iterator(texts, trainer=trainer)
    got = tok.get_vocab_size()
    if got < vocab_size:
        raise ConfigError(
            "data.vocab_size",
            f"the corpus only supports {got} tokens, fewer than the {vocab_size} asked for; "
            f"lower data.vocab_size to at most {got} or add text",
        )
    tok.encode_special_tokens = True
    return tok


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> tuple[str, ...]:
    """The character byte-level BPE writes for each byte 0..255 (GPT-2's bytes_to_unicode): the
    printable bytes as themselves, the others as chr(256), chr(257), ... in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return tuple(chr(b if b in printable else next(extra)) for b in range(256))


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    """Write tokenizer.json atomically (temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, tok.to_str())


def tokenizer_sha256(path: str | Path) -> str:
    """sha256 of a tokenizer's content (its compact JSON), not of the file's bytes: minillm's own
    files are written compact, so the two agree there, and an exported, pretty-printed copy of
    the same tokenizer gets the same digest. A file `tokenizers` cannot read: its bytes' digest."""
    import hashlib

    from minillm.runtime.files import sha256_file

    try:
        text = Tokenizer.from_file(str(path)).to_str()
    except Exception:  # tokenizers raises a bare Exception for bad JSON or schema
        return sha256_file(path)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read a tokenizer.json; a missing or unreadable file is a UserError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            "data.tokenizer", "no such tokenizer; run `minillm tokenize CONFIG` first", str(path)
        )
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for bad JSON or schema
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            "data.tokenizer", f"not a readable tokenizer.json: {first}", str(path)
        ) from None
    tok.encode_special_tokens = True
    return tok


def special_tokens(tok: Tokenizer) -> list[str]:
    """The special added tokens of `tok`, in id order."""
    added = tok.get_added_tokens_decoder()
    return [added[i].content for i in sorted(added) if added[i].special]


def check_tokenizer(tok: Tokenizer, vocab_size: int, path: str | Path) -> None:
    """A reused tokenizer must have the configured size and exactly our special tokens (or only
    `<|endoftext|>`: a tokenizer from before the chat tokens, fine for plain text), unless it is
    a published model's (`is_published`): then its own special tokens are its conventions."""
    got = tok.get_vocab_size()
    if got != vocab_size:
        owner = _owner(Path(path))
        # A model's or a published tokenizer cannot be retrained (check_not_a_models_tokenizer):
        # the fix is the size, not --retrain, which would only send the user back here.
        if owner:
            fix = (
                f"it belongs to {owner} in {Path(path).parent}: set data.vocab_size to {got} (or "
                "leave it out with train.init_from)"
            )
        elif not _written_by_minillm(tok, Path(path)):
            fix = f"it is a published tokenizer: set data.vocab_size to {got} to use it"
        else:
            fix = f"set data.vocab_size to {got} to use it, or pass --retrain to replace it"
        raise ConfigError(
            "data.vocab_size",
            f"the existing tokenizer has {got} tokens but data.vocab_size is {vocab_size}; {fix}",
            str(path),
        )
    specials = special_tokens(tok)
    if specials not in (list(SPECIAL_TOKENS), list(LEGACY_SPECIAL_TOKENS)) and not is_published(
        Path(path)
    ):
        raise ConfigError(
            "data.tokenizer",
            f"the existing tokenizer's special tokens are {specials}, expected "
            f"{list(SPECIAL_TOKENS)}; pass --retrain to replace it",
            str(path),
        )


def eot_id(tok: Tokenizer) -> int:
    """The id of the end-of-text (document separator) token."""
    i = tok.token_to_id(EOT)
    if i is None:
        raise ConfigError("data.tokenizer", f"the tokenizer has no {EOT} token")
    return i


def _owner(tok_path: Path) -> str:
    """What holds weights trained on `tok_path` beside it (`the run`, `the checkpoint`, `the
    Hugging Face model`), or "" for a tokenizer of its own."""
    folder = tok_path.parent
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return "the Hugging Face model"
    if (folder / "state.json").is_file():
        return "the checkpoint"
    if (folder / "checkpoints").is_dir() or (folder / "train.lock").exists():
        return "the run"
    return ""


def is_published(tok_path: Path) -> bool:
    """Whether `tok_path` is a published model's tokenizer: a Hugging Face model's (weights
    beside it) or one with its tokenizer_config.json (a chat template, bos and eos of its own),
    used as transformers uses it (minillm.tokenizer.conventions)."""
    folder = tok_path.parent
    return (folder / "tokenizer_config.json").is_file() or _owner(tok_path) == (
        "the Hugging Face model"
    )


def _written_by_minillm(tok: Tokenizer, tok_path: Path) -> bool:
    """Whether the tokenizer at `tok_path` is one `minillm tokenize` trained: our special tokens
    and no published model's tokenizer_config.json beside it."""
    ours = special_tokens(tok) in (list(SPECIAL_TOKENS), list(LEGACY_SPECIAL_TOKENS))
    return ours and not is_published(tok_path)


def check_not_a_models_tokenizer(tok_path: Path) -> None:
    """A UserError if `tok_path` is the tokenizer of a model: a Hugging Face folder with weights
    (config.json and *.safetensors beside it), a minillm checkpoint (state.json) or run
    (checkpoints/ or its train.lock). Retraining it would leave those weights with ids that no
    longer mean what they were trained on."""
    owner = _owner(tok_path)
    if not owner:
        try:
            tok = Tokenizer.from_file(str(tok_path))
        except Exception:  # not a tokenizer at all: --retrain may replace it
            return
        if _written_by_minillm(tok, tok_path):
            return
        raise UserError(
            f"{tok_path}: data.tokenizer: a published tokenizer, not one minillm trained; "
            "--retrain does not replace it: point data.tokenizer at a new file (or drop "
            "--retrain to use it)"
        )
    folder = tok_path.parent
    raise UserError(
        f"{tok_path}: data.tokenizer: belongs to {owner} in {folder}, whose weights need it; "
        "--retrain does not replace it: point data.tokenizer at a new file (or drop --retrain "
        "to use it)"
    )
