"""Text from a stream of token ids, one piece at a time, for printing and for serving.

Offers `TextStreamer` (pieces that never split a UTF-8 character), `StopText` (the same,
cut at the first stop string) and `continuation` (a reply's whole text). Byte-level BPE and
sentencepiece's byte fallback can split one character over several tokens; decoding each token
alone would print replacement characters. A sentencepiece decoder drops the space before the
first word of what it decodes (the "▁" its pre-tokenizer put there), so a reply is decoded after
the last tokens of its prompt (`CONTEXT`), never alone: " was" after "The king" keeps its space.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTEXT = 4  # prompt tokens a reply is decoded after (vLLM's detokenizer takes 5)


def continuation(tokenizer: Any, context: Sequence[int], tokens: Sequence[int]) -> str:
    """The text `tokens` add after `context` (a prompt's ids; its last CONTEXT count)."""
    head = list(context[-CONTEXT:]) if CONTEXT else []
    return tokenizer.decode([*head, *tokens])[len(tokenizer.decode(head)) :]


class TextStreamer:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8 characters.

    Like vLLM, only a short window of recent tokens is decoded per token, starting after the
    last tokens of `context` (the prompt), whose text is not printed.
    """

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context[-CONTEXT:]) if CONTEXT else []
        # ids[prefix:read] were printed (or are the context) and end on a character boundary
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token: int) -> str:
        """Add one token; return the text it completes (maybe empty)."""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back (a character cut by the end of generation)."""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]


class StopText:
    """Text pieces of a row: whole characters only (TextStreamer), cut at the first stop string.

    Text that could be the start of a stop string is held back until it is known not to be, so
    a stop string split over several tokens is never half released.
    """

    def __init__(
        self, tokenizer: Any, stop: tuple[str, ...] = (), context: Sequence[int] = ()
    ) -> None:
        self.streamer = TextStreamer(tokenizer, context)
        self.stop = stop
        self.text = ""  # everything decoded so far
        self.sent = 0  # text[:sent] was released
        self.stopped = False  # a stop string was found: nothing more is released

    def push(self, token: int) -> str:
        self.text += self.streamer.push(token)
        return self._release(final=False)

    def finish(self) -> str:
        """The held-back rest, at the end of generation."""
        if not self.stopped:
            self.text += self.streamer.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self.text)
        if self.stop:
            # A stop string starts in the held-back text: released text never begins one.
            hits = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
            if hits:
                end = min(hits)
                self.stopped = True
            elif not final:
                longest = max(len(s) for s in self.stop)
                for n in range(min(longest - 1, end - self.sent), 0, -1):
                    if any(s.startswith(self.text[end - n :]) for s in self.stop):
                        end -= n
                        break
        out = self.text[self.sent : end]
        self.sent = end
        return out
