"""Tokens as OpenAI's log-probability objects show them: their text, bytes and text offsets.

Offers `TokenText`: `chat_logprobs(infos)` (a chat choice's `logprobs.content`) and
`completion_logprobs(infos, text_start)` (the legacy `{tokens, token_logprobs, top_logprobs,
text_offset}`). A token can hold part of a UTF-8 character (a byte-level BPE's piece, a
sentencepiece byte-fallback token `<0xE4>`), so a token's bytes are what its tokenizer's kind
spells (the conventions' `token_bytes`, minillm.tokenizer.pieces), not a decoding of it alone;
its text is those bytes decoded with replacement characters, as OpenAI shows such tokens.
"""

from __future__ import annotations

import functools
from typing import Any

from minillm.infer.engine import TokenLogprob


class TokenText:
    """Bytes and text of token ids for one tokenizer, given its conventions (special tokens:
    their name, no bytes)."""

    def __init__(self, conv: Any) -> None:
        self.conv = conv
        added = conv.tok.get_added_tokens_decoder()
        self.special = {int(i): t.content for i, t in added.items()}

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one TokenText per server)
    def token_bytes(self, token: int) -> bytes:
        return b"" if token in self.special else self.conv.token_bytes(token)

    def token_str(self, token: int) -> str:
        if token in self.special:
            return self.special[token]
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def _entry(self, token: int, logprob: float | None) -> dict[str, Any]:
        return {
            "token": self.token_str(token),
            "logprob": logprob,
            "bytes": list(self.token_bytes(token)),
        }

    def chat_logprobs(self, infos: list[TokenLogprob]) -> list[dict[str, Any]]:
        """OpenAI's chat `logprobs.content` entries."""
        return [
            {**self._entry(i.id, i.logprob), "top_logprobs": [self._entry(t, v) for t, v in i.top]}
            for i in infos
        ]

    def completion_logprobs(
        self, infos: list[TokenLogprob], text_start: int, data: bytes = b"", top: bool = True
    ) -> tuple[dict[str, Any], bytes]:
        """The legacy logprobs object of these tokens; offsets count characters of the whole
        text, of which `data` (UTF-8 bytes) comes before them at character `text_start`.
        Returns the object and `data` extended by these tokens' bytes (for the next call)."""
        base = len(data.decode("utf-8", errors="ignore"))
        offsets = []
        for i in infos:
            offsets.append(text_start + len(data.decode("utf-8", errors="ignore")) - base)
            data += self.token_bytes(i.id)
        return {
            "tokens": [self.token_str(i.id) for i in infos],
            "token_logprobs": [i.logprob for i in infos],
            "top_logprobs": (
                [
                    {self.token_str(t): v for t, v in i.top} if i.logprob is not None else None
                    for i in infos
                ]
                if top
                else None
            ),
            "text_offset": offsets,
        }, data
