"""The Ollama Modelfile written beside a GGUF file: `modelfile_path`, `modelfile_text`,
`ollama_format` and `OLLAMA_CHAT_TEMPLATE`.

Ollama renders a chat with a Go template (TEMPLATE), not the model's Jinja one. minillm writes
the template in Go for the chat formats Ollama itself ships, recognised by what the model's
Jinja template renders, not by its text: each format (FORMATS) has its Go template and the same
template as a Python function, and a format is the model's when the Jinja template renders two
probe conversations (one led by a system message) to the function's text. A template that fills
in a system message where the conversation has none (SmolLM2's, Qwen2.5's) gets it as Ollama's
SYSTEM, which Ollama puts first when a chat has no system message. Any other template gets no
TEMPLATE, a comment in the Modelfile and one warning saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minillm.config import SampleConfig
from minillm.errors import UserError, warn
from minillm.tokenizer.chat_template import HF_CHAT_TEMPLATE

Messages = list[dict[str, str]]

# minillm's own chat format (<|role|>content<|end|>, then <|assistant|>), in Go.
OLLAMA_CHAT_TEMPLATE = (
    "{{- range .Messages }}<|{{ .Role }}|>{{ .Content }}<|end|>{{ end }}<|assistant|>"
)


@dataclass(frozen=True)
class ChatFormat:
    """A chat format Ollama ships: its name, its Go template, the same template in Python (the
    text of a conversation, generation prompt included, without the BOS the tokenizer adds) and
    whether it has a system role."""

    name: str
    go: str
    text: Callable[[Messages], str]
    system: bool = True


def _chatml(ms: Messages) -> str:
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in ms)
    return turns + "<|im_start|>assistant\n"


def _llama3(ms: Messages) -> str:
    head = "<|start_header_id|>{}<|end_header_id|>\n\n"
    turns = "".join(head.format(m["role"]) + m["content"] + "<|eot_id|>" for m in ms)
    return turns + head.format("assistant")


def _phi(newline: str) -> Callable[[Messages], str]:
    def text(ms: Messages) -> str:
        turns = "".join(f"<|{m['role']}|>{newline}{m['content']}<|end|>{newline}" for m in ms)
        return turns + f"<|assistant|>{newline}"

    return text


def _gemma(ms: Messages) -> str:
    """Gemma has no system role: a system message opens the first user turn."""
    out, system = [], ""
    for m in ms:
        if m["role"] == "system":
            system = m["content"] + "\n\n"
        elif m["role"] == "user":
            out.append(f"<start_of_turn>user\n{system}{m['content']}<end_of_turn>\n")
            system = ""
        else:
            out.append(f"<start_of_turn>model\n{m['content']}<end_of_turn>\n")
    return "".join(out) + "<start_of_turn>model\n"


def _mistral(ms: Messages) -> str:
    return "".join(
        f"[INST] {m['content']} [/INST]" if m["role"] == "user" else f"{m['content']}</s>"
        for m in ms
    )


def _llama2(ms: Messages) -> str:
    out, system, first = [], "", True
    for m in ms:
        if m["role"] == "system":
            system = f"<<SYS>>\n{m['content']}\n<</SYS>>\n\n"
        elif m["role"] == "user":
            out.append(("" if first else "<s>") + f"[INST] {system}{m['content']} [/INST]")
            system, first = "", False
        else:
            out.append(f" {m['content']} </s>")
    return "".join(out)


_PHI3_GO = "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n"
FORMATS = [
    ChatFormat(
        "ChatML",
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
        "<|im_start|>assistant\n",
        _chatml,
    ),
    ChatFormat(
        "Llama 3",
        "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
        "{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
        _llama3,
    ),
    ChatFormat("Phi-3", _PHI3_GO, _phi("\n")),
    ChatFormat("Phi-4", OLLAMA_CHAT_TEMPLATE, _phi("")),
    ChatFormat(
        "Gemma",
        '{{- $system := "" }}{{ range .Messages }}{{ if eq .Role "system" }}'
        '{{ $system = printf "%s\\n\\n" .Content }}{{ else if eq .Role "user" }}'
        "<start_of_turn>user\n{{ $system }}{{ .Content }}<end_of_turn>\n"
        '{{ $system = "" }}{{ else }}<start_of_turn>model\n{{ .Content }}<end_of_turn>\n'
        "{{ end }}{{ end }}<start_of_turn>model\n",
        _gemma,
    ),
    ChatFormat(
        "Mistral [INST]",
        '{{- range .Messages }}{{ if eq .Role "user" }}[INST] {{ .Content }} [/INST]'
        '{{ else if eq .Role "assistant" }}{{ .Content }}</s>{{ end }}{{ end }}',
        _mistral,
        system=False,
    ),
    ChatFormat(
        "Llama 2 [INST]",
        '{{- $system := "" }}{{ $first := true }}{{ range .Messages }}'
        '{{ if eq .Role "system" }}{{ $system = printf "<<SYS>>\\n%s\\n<</SYS>>\\n\\n" .Content }}'
        '{{ else if eq .Role "user" }}{{ if not $first }}<s>{{ end }}[INST] {{ $system }}'
        '{{ .Content }} [/INST]{{ $system = "" }}{{ $first = false }}'
        "{{ else }} {{ .Content }} </s>{{ end }}{{ end }}",
        _llama2,
    ),
]

_PROBE: Messages = [
    {"role": "user", "content": "Who goes there?"},
    {"role": "assistant", "content": "A friend."},
    {"role": "user", "content": "Stand and unfold yourself."},
]
_SYSTEM = {"role": "system", "content": "Speak as a sentry."}
_MARK = "\x00system\x00"


@dataclass(frozen=True)
class OllamaFormat:
    """The model's chat template as Ollama's: the format's name, its Go TEMPLATE (the BOS
    first where the template writes one and the tokenizer adds none) and the default SYSTEM."""

    name: str
    template: str
    system: str | None


def ollama_format(source: str, special: dict[str, Any], adds_bos: bool) -> OllamaFormat | None:
    """The chat format of Jinja template `source` (None: none of FORMATS renders as it does)."""
    from minillm.tokenizer import jinja_chat

    bos = special.get("bos_token") if isinstance(special.get("bos_token"), str) else None

    def jinja(ms: Messages) -> tuple[str | None, bool]:
        """(the template's text without a leading BOS, or None where it refuses; BOS seen)."""
        try:
            text, _ = jinja_chat.render(source, ms, True, special)
        except UserError:
            return None, False
        if bos and text.startswith(bos):
            return text[len(bos) :], True
        return text, False

    (plain, wrote_bos), (with_system, _) = jinja(_PROBE), jinja([_SYSTEM, *_PROBE])
    if plain is None:
        return None
    for f in FORMATS:
        if with_system is not None and (not f.system or with_system != f.text([_SYSTEM, *_PROBE])):
            continue
        default = None
        if plain != f.text(_PROBE):
            if not f.system:
                continue
            before, _, after = f.text([{"role": "system", "content": _MARK}, *_PROBE]).partition(
                _MARK
            )
            if not (plain.startswith(before) and plain.endswith(after)):
                continue
            default = plain[len(before) : len(plain) - len(after)]
            if not default or f.text([{"role": "system", "content": default}, *_PROBE]) != plain:
                continue
        go = (bos if wrote_bos and bos and not adds_bos else "") + f.go
        return OllamaFormat(f.name, go, default)
    return None


def modelfile_path(out: str | Path) -> Path:
    """The Ollama Modelfile written beside `out`: model.gguf -> model.Modelfile."""
    return Path(out).with_suffix(".Modelfile")


def _quoted(text: str) -> str:
    return '"""' + text + '"""'


def modelfile_text(
    gguf_name: str,
    ids: Any,
    sample: SampleConfig,
    context: int,
    special: dict[str, Any] | None = None,
) -> str:
    """An Ollama Modelfile for the .gguf beside it: the template, stop tokens, context and the
    run's sampling defaults (`ollama create NAME -f FILE.Modelfile`). `ids` is the file's
    GgufSpecials; `special` the tokenizer's special tokens by name, which the Jinja template
    sees. Where no TEMPLATE is written, the file says why and a warning says so once."""
    lines = [
        "# Ollama: ollama create NAME -f THIS_FILE, then ollama run NAME (written by minillm)",
        f"FROM ./{gguf_name}",
    ]
    if ids.template is None:  # no chat template: the prompt is the text, as `minillm sample`
        lines.append(f"TEMPLATE {_quoted('{{ .Prompt }}')}")
    elif ids.template == HF_CHAT_TEMPLATE:  # minillm's own
        lines.append(f"TEMPLATE {_quoted(OLLAMA_CHAT_TEMPLATE)}")
    else:
        found = ollama_format(ids.template, special or {}, ids.add_bos)
        if found is None:
            why = (
                "the model's chat template is none of the formats minillm writes in Ollama's Go "
                f"form ({', '.join(f.name for f in FORMATS)})"
            )
            lines.append(f"# No TEMPLATE: {why}; Ollama then uses the template it ships that")
            lines.append("# matches the file's tokenizer.chat_template, if any (check it with")
            lines.append("# `ollama show --template NAME`).")
            warn(f"{gguf_name}: the Modelfile has no TEMPLATE: {why}")
        else:
            lines.append(f"# TEMPLATE: the model's chat template ({found.name}) in Go form")
            lines.append(f"TEMPLATE {_quoted(found.template)}")
            if found.system is not None:  # the template's own, where a chat has none
                lines.append(f"SYSTEM {_quoted(found.system)}")
    lines += [
        *(f'PARAMETER stop "{s}"' for s in ids.stops),
        # Past the trained context RoPE positions are unseen; Ollama's default may be longer.
        f"PARAMETER num_ctx {context}",
        f"PARAMETER temperature {sample.temperature:g}",
    ]
    if sample.temperature > 0:  # written when off (0, 1) too: Ollama's defaults are 40 and 0.9
        lines.append(f"PARAMETER top_p {sample.top_p:g}")
        lines.append(f"PARAMETER top_k {sample.top_k}")
    return "\n".join(lines) + "\n"
