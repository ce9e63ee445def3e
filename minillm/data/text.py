"""Plain text for the tokenizer: UTF-8 read in blocks, and where a text may be cut.

Offers `read_text_blocks`, `first_invalid_byte`, `split_pieces`, `is_cut`, `NOT_UTF8` and the
sizes `BLOCK_BYTES`, `PIECE_CHARS`.

Files are decoded about a megabyte at a time, so memory does not grow with a file; bad UTF-8 or
a NUL byte is a UserError that names the file and the byte offset, unless the caller asks for
invalid bytes to be replaced (`data.decode_errors`, applied by minillm.data.corpus). Long texts
are then cut into pieces, to encode them on every core and in bounded memory, but only where
encoding the two sides separately gives the same token ids as encoding the whole (`is_cut`), so
the shards do not depend on block or piece sizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from minillm.errors import ConfigError

BLOCK_BYTES = 1 << 20  # bytes read from a text file at a time
PIECE_CHARS = 1 << 16  # target length of the pieces handed to the encoder
# What a strict read says of invalid UTF-8, after "at byte N" (a file) or "in row N" (a table).
NOT_UTF8 = (
    "set data.decode_errors to replace (invalid bytes become U+FFFD) or skip_document (such "
    "documents are left out) to read past it"
)


def _fail(path: str | Path, message: str) -> ConfigError:
    return ConfigError("data.source", message, str(path))


class _NotUTF8(ConfigError):
    """A strict read's invalid UTF-8 at file offset `offset`."""

    def __init__(self, path: str | Path, offset: int) -> None:
        super().__init__("data.source", f"not UTF-8 text at byte {offset}; {NOT_UTF8}", str(path))
        self.offset = offset


def is_cut(text: str, i: int) -> bool:
    """Whether `text[:i]` and `text[i:]` pre-tokenize (so encode) exactly like `text` does there.

    GPT-2's byte-level regex looks ahead only in `\\s+(?!\\S)`, so a cut is safe where a
    whitespace run of one character sits between two non-whitespace characters:
    - right after a lone "\\n" (`"a\\nB"` -> `"a\\n" | "B"`). The "\\n" must be lone: the whole
      `"a\\n\\nB"` splits into "\\n", "\\n" but the piece `"a\\n\\n"` ends in one "\\n\\n" token.
    - right before a lone " " (`"a b"` -> `"a" | " b"`), the fallback for text without such line
      breaks (CRLF files, one long line).
    Both were checked against the pre-tokenizer for every Unicode code point; `str.isspace` is a
    superset of the regex's `\\s`, which only makes us cut less often.
    """
    n = len(text)
    if 2 <= i < n and text[i - 1] == "\n":
        if not text[i - 2].isspace() and not text[i].isspace():
            return True
    if 1 <= i < n - 1 and text[i] == " ":
        return not text[i - 1].isspace() and not text[i + 1].isspace()
    return False


def _find_cut(text: str, lo: int, hi: int, last: bool) -> int:
    """The last (or first) cut i with lo < i <= hi, preferring line breaks; -1 if there is none."""
    for char, shift in (("\n", 1), (" ", 0)):  # a cut at j + shift where text[j] == char
        a, b = lo + 1 - shift, hi + 1 - shift
        j = text.rfind(char, a, b) if last else text.find(char, a, b)
        while j != -1:
            if is_cut(text, j + shift):
                return j + shift
            j = text.rfind(char, a, j) if last else text.find(char, j + 1, b)
    return -1


def split_pieces(blocks: Iterable[str], target: int | None = None) -> Iterator[str]:
    """Re-cut a document's text blocks into pieces of about `target` (PIECE_CHARS) characters.

    Pieces end at safe cuts, so encoding them one by one gives the same ids as encoding the whole
    document. Text with no safe cut at all (no lone space or line break) is held until one
    appears, so only such pathological text can make a piece, and memory, grow.
    """
    target = target or PIECE_CHARS
    carry = ""
    for block in blocks:
        text = carry + block if carry else block
        pos = 0
        while len(text) - pos > target:
            cut = _find_cut(text, pos, pos + target, last=True)
            if cut < 0:
                cut = _find_cut(text, pos + target, len(text), last=False)
            if cut < 0:
                break
            yield text[pos:cut]
            pos = cut
        carry = text[pos:]
    if carry:
        yield carry


def _complete_prefix(data: bytes) -> int:
    """The length of `data` without a trailing, incomplete UTF-8 sequence."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 != 0x80:  # not a continuation byte: ASCII or the lead byte of a sequence
            need = 4 if b >= 0xF0 else 3 if b >= 0xE0 else 2 if b >= 0xC0 else 1  # its length
            return len(data) - back if need > back else len(data)
    return len(data)


def read_text_blocks(
    path: str | Path,
    start: int = 0,
    end: int | None = None,
    block_bytes: int | None = None,
    errors: str = "strict",
) -> Iterator[str]:
    """Decode bytes [start, end) of a file as UTF-8, `block_bytes` (BLOCK_BYTES) at a time.

    A NUL byte (a binary file) is a UserError naming the file and byte offset, and so is invalid
    UTF-8 with `errors="strict"`; "replace" makes it U+FFFD (Python's rule: one per maximal
    invalid sequence), "surrogateescape" one lone surrogate per byte (so the text encodes back to
    the file's exact bytes: where safe cuts fall). Blocks end only before a byte that starts a
    character, so the text is the same as decoding the whole file at once.
    """
    block_bytes = block_bytes or BLOCK_BYTES
    try:
        f = open(path, "rb")  # closed by `with` below, also when the caller stops early
    except OSError as e:
        raise _fail(path, f"cannot read: {e.strerror or e}") from None
    with f:
        f.seek(start)
        remaining = None if end is None else end - start
        offset, carry = start, b""  # file offset of carry[0]
        while True:
            try:
                raw = f.read(block_bytes if remaining is None else min(block_bytes, remaining))
            except OSError as e:
                raise _fail(path, f"cannot read: {e.strerror or e}") from None
            if remaining is not None:
                remaining -= len(raw)
            data = carry + raw if carry else raw
            keep = _complete_prefix(data) if raw else len(data)
            try:
                text = data[:keep].decode("utf-8")
            except UnicodeDecodeError as e:
                if errors == "strict":
                    raise _NotUTF8(path, offset + e.start) from None
                text = data[:keep].decode("utf-8", errors)
            if "\x00" in text:  # a 0 byte is never inside a character: find it in the bytes
                where = offset + data.index(b"\x00")
                raise _fail(path, f"a NUL byte at byte {where}: binary file?")
            if text:
                yield text
            offset += keep
            carry = data[keep:]
            if not raw:
                return


def first_invalid_byte(path: str | Path, start: int = 0, end: int | None = None) -> int | None:
    """The file offset of the first byte in [start, end) that is not UTF-8, or None: all valid.

    A NUL byte is a UserError, as when reading."""
    try:
        for _ in read_text_blocks(path, start, end):
            pass
    except _NotUTF8 as e:
        return e.offset
    return None
