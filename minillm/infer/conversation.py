"""`minillm chat`: a conversation with a chat-tuned checkpoint, in its chat template (minillm's
own, or a published model's: minillm.tokenizer.conventions).

Offers `Conversation` (the history and one reply at a time), `warn_if_text_model` and
`chat_checkpoint`, what the command runs: one reply to `--message`, an interactive conversation
on a terminal, or from a pipe one conversation whose user turns are the input lines, one reply
each (on one line: its line breaks become spaces, so a reader can pair lines).

A prompt is the conversation so far with the template's generation prompt (minillm's own:
`<|assistant|>`); the reply comes from the decoding core (`minillm.infer.engine`) and stops at
the model's stop set (minillm's own: `<|end|>` or `<|endoftext|>`; a published model's eos ids
and end-of-turn token), as `minillm serve` and `eval --task`. When the history no longer fits
the context with room for the reply, the oldest exchanges are dropped (the system message
stays). Turn t of a conversation seeded s is a request seeded s + t, so the first
reply is the one `minillm serve` gives a chat request with the same seed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from minillm.errors import UserError, warn
from minillm.infer.engine import Engine, Event, SamplingParams
from minillm.infer.grammar import schema_grammar
from minillm.infer.sampling import fresh_seed

if TYPE_CHECKING:
    from minillm.checkpoint.store import LoadedCheckpoint

HELP = "type a message; /reset starts over, /exit (or Ctrl-D) leaves"


def trained_on_chat(ckpt: Any) -> bool | None:
    """Whether the checkpoint's run trained on chat data, as its data.out_dir's meta.json says
    (None when that folder is not here: run from elsewhere, the shards deleted)."""
    meta = Path(ckpt.config.data.out_dir) / "meta.json"
    try:
        return bool(json.loads(meta.read_text()).get("chat"))
    except (OSError, ValueError, AttributeError):
        return None


def warn_if_text_model(ckpt: Any) -> None:
    """One warning when a chat reply is asked of a model trained on plain text (chat, tasks)."""
    if trained_on_chat(ckpt) is False:
        warn(
            f"{ckpt.path}: this model was trained on text, not chat (its data.out_dir's "
            "meta.json): its tokenizer has the chat tokens, but their replies are likely "
            "nonsense; fine-tune it on conversations first"
        )


class Conversation:
    """The messages so far with a model; `reply(text)` adds a user turn and the answer."""

    def __init__(
        self,
        ckpt: LoadedCheckpoint,
        params: SamplingParams,
        system: str | None,
        err: TextIO,
        json_schema: tuple[Path, dict] | None = None,
    ) -> None:
        self.tok, self.conv = ckpt.tokenizer, ckpt.conventions
        self.conv.check_chat(f"{ckpt.path}: --ckpt")
        params = params.resolve(ckpt.config.sample)
        self.context = ckpt.model.cfg.max_seq_len
        if params.max_new_tokens >= self.context:
            raise UserError(
                f"--max-new-tokens {params.max_new_tokens} leaves no room for a prompt in the "
                f"model's context of {self.context} tokens"
            )
        if params.seed is None and params.temperature > 0:
            params = dataclasses.replace(params, seed=fresh_seed())
            print(f"seed {params.seed} (pass --seed to repeat these replies)", file=err)
        # A reply's text is decoded on its own (`tokenizer.decode(reply)`), streamed or not.
        self.params = dataclasses.replace(params, stop_ids=self.conv.stop_ids, text_alone=True)
        if json_schema is not None:  # (file, schema): every reply is a JSON the schema accepts
            where = f"--json-schema {json_schema[0]}"
            grammar = schema_grammar(json_schema[1], self.tok, self.conv.stop_ids, where)
            self.params = dataclasses.replace(self.params, grammar=grammar)
        self.engine = Engine(ckpt.model, self.tok)
        self.system = system
        self.turns = 0
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict[str, str]] = []
        if self.system:
            self.messages.append({"role": "system", "content": self.system})

    def _prompt(self) -> list[int]:
        """The prompt ids, dropping the oldest turns (not the system message) until they fit."""
        room = self.context - self.params.max_new_tokens + 1  # the last token needs no slot
        while True:
            ids = self.conv.chat_ids(self.messages, add_generation_prompt=True)
            if len(ids) <= room:
                return ids
            first = 1 if self.messages[0]["role"] == "system" else 0
            if len(self.messages) - first <= 1:  # only the new message is left: cut its head
                return ids[-room:]
            del self.messages[first]
            while len(self.messages) - first > 1 and self.messages[first]["role"] == "assistant":
                del self.messages[first]  # a conversation starts with a user turn

    def reply(self, text: str, out: TextIO | None = None) -> str:
        """Add the user's `text`, generate the answer (streamed to `out`), keep it; return it."""
        self.messages.append({"role": "user", "content": text})
        params = self.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + self.turns)
        (row,) = self.engine.submit([self._prompt()], params)

        def stream(event: Event) -> None:
            if event.text and out is not None:
                out.write(event.text)
                out.flush()

        self.engine.run(stream)
        stops = self.params.stop_ids
        answer = self.tok.decode([t for t in row.tokens if t not in stops])
        self.messages.append({"role": "assistant", "content": answer})
        self.turns += 1
        return answer


def chat_checkpoint(
    ckpt: LoadedCheckpoint,
    params: SamplingParams,
    system: str | None = None,
    message: str | None = None,
    stdin: TextIO | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    json_schema: tuple[Path, dict] | None = None,
) -> None:
    """What `minillm chat` runs (module docstring); json_schema: (its file, the schema)."""
    stdin = stdin if stdin is not None else sys.stdin
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if message is not None and not message.strip():
        raise UserError("--message: empty message")
    conv = Conversation(ckpt, params, system, err, json_schema)
    warn_if_text_model(ckpt)
    if message is not None:
        out.write(conv.reply(message) + "\n")
        out.flush()
        return
    if not stdin.isatty():  # a pipe: each line is the next user turn, each reply one line
        for line in stdin:
            text = line.rstrip("\n")
            if text.strip():
                out.write(conv.reply(text).replace("\n", " ") + "\n")
                out.flush()
        return
    print(HELP, file=err)
    while True:
        try:
            text = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=err)
            return
        command = text.strip()
        if command == "/exit":
            return
        if command == "/reset":
            conv.reset()
            print("(a new conversation)", file=err)
            continue
        if not command:
            continue
        out.write("assistant> ")
        try:
            conv.reply(text, out)
        except KeyboardInterrupt:  # Ctrl-C leaves, also in the middle of a reply
            out.write("\n")
            return
        out.write("\n")
        out.flush()
