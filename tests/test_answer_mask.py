"""The answer-only mask of published templates that render a conversation's start otherwise
once a reply follows (issue 50, defects 1 and 2): Mistral-Nemo-Instruct-2407 (and Mistral v0.3)
move the system prompt into the last user turn; DeepSeek-R1-Distill's generation prompt opens a
<think> its finished turns lack. Without `{% generation %}` markers minillm finds each reply
from renderings of the conversation; the masks must be transformers'
`return_assistant_tokens_mask` on the same template with the markers added, also for replies
whose text occurs in the user turns and replies with leading whitespace."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from minillm.tokenizer.bpe import load_tokenizer
from minillm.tokenizer.conventions import Conventions
from tests.published import family_tokenizer, hf_tokenizer

# Mistral-Nemo-Instruct-2407's template as published, its tool-calling branches left out.
NEMO = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must "
    "alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST]' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST]' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "REPLY"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported') }}"
    "{%- endif %}{%- endfor %}"
)
NEMO_REPLY = "{{- message['content'] + eos_token }}"
NEMO_MARKED = "{% generation %}{{- message['content'] + eos_token }}{% endgeneration %}"

# DeepSeek-R1-Distill-Qwen's template as published, its tool-calling branches left out.
R1 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}"
    "{% set ns = namespace(system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}"
    "{% endif %}"
    "REPLY"
    "{%- endif %}{%- endfor -%}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)
R1_REPLY = "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}"
R1_MARKED = (
    "{{ '<｜Assistant｜>' }}{% generation %}{{ content + '<｜end▁of▁sentence｜>' }}"
    "{% endgeneration %}"
)
R1_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]

VOWELS = [
    {"role": "user", "content": "Which is a vowel: A or B?"},
    {"role": "assistant", "content": "A"},
    {"role": "user", "content": "And now: C or E?"},
    {"role": "assistant", "content": "E"},
]
SYSTEM = [{"role": "system", "content": "Answer with one letter."}, *VOWELS]
SPACED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say yes"},
    {"role": "assistant", "content": " yes"},
    {"role": "user", "content": "Again: yes"},
    {"role": "assistant", "content": "  yes\n"},
]
THINKING = [
    {"role": "user", "content": "2+2? Say 4"},
    {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
    {"role": "user", "content": "and 4"},
    {"role": "assistant", "content": " 4"},
]


def folder(root: Path, name: str, template: str) -> Path:
    """A tokenizer folder of the family's special tokens with this template."""
    out = root / name
    out.mkdir()
    if name.startswith("nemo"):
        tok = family_tokenizer("mistral")
        config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    else:
        tok = Tokenizer.from_str(family_tokenizer("chatml").to_str())
        tok.add_special_tokens(R1_SPECIALS)
        config = {"bos_token": R1_SPECIALS[0], "eos_token": R1_SPECIALS[1]}
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **config}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("family", "messages"),
    [("nemo", VOWELS), ("nemo", SYSTEM), ("nemo", SPACED), ("r1", SPACED), ("r1", THINKING),
     ("r1", VOWELS)],
)  # fmt: skip
def test_answer_only_mask_is_transformers_on_the_marked_template(
    tmp_path: Path, family: str, messages: list[dict]
) -> None:
    base, reply, marked = (NEMO, NEMO_REPLY, NEMO_MARKED) if family == "nemo" else (
        R1, R1_REPLY, R1_MARKED)  # fmt: skip
    plain = folder(tmp_path, family, base.replace("REPLY", reply))
    theirs = hf_tokenizer(folder(tmp_path, f"{family}-marked", base.replace("REPLY", marked)))
    want = theirs.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    conv = Conventions.of(load_tokenizer(plain / "tokenizer.json"), plain)
    ids, mask = conv.chat_targets(messages)
    assert ids == list(want["input_ids"])
    targets = conv.tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    expected = [t for t, m in zip(ids, want["assistant_masks"]) if m]
    assert targets == conv.tok.decode(expected, skip_special_tokens=False)
    assert mask == [bool(m) for m in want["assistant_masks"]]


def test_the_vowel_replies_are_the_targets_not_the_questions(tmp_path: Path) -> None:
    """The issue's case: the replies 'A' and 'E' also occur in the questions."""
    plain = folder(tmp_path, "nemo", NEMO.replace("REPLY", NEMO_REPLY))
    conv = Conventions.of(load_tokenizer(plain / "tokenizer.json"), plain)
    ids, mask = conv.chat_targets(SYSTEM)
    assert conv.tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False) == (
        "A</s>E</s>"
    )


# Llama 2's template writes ' ' before each reply (Mistral v0.1's did too): after `[/INST]`, a
# reply that starts with a digit or a newline gets that space as its own `▁` token. The
# generation mask starts at the reply's content, as transformers' does with the markers after
# the space: the separator is the template's, not the reply's.
LLAMA2_REPLY = "{{ ' '  + content.strip() + ' ' + eos_token }}"
LLAMA2_MARKED = (
    "{{ ' ' }}{% generation %}{{ content.strip() + ' ' + eos_token }}{% endgeneration %}"
)
DIGITS = [
    {"role": "user", "content": "What is six times seven?"},
    {"role": "assistant", "content": "42, it is."},
    {"role": "user", "content": "And again?"},
    {"role": "assistant", "content": "42"},
]


def test_the_space_before_a_llama2_reply_is_not_a_target(tmp_path: Path) -> None:
    from tests.published import FAMILIES

    base = FAMILIES["llama2"]["template"]
    assert LLAMA2_REPLY in base
    tok = family_tokenizer("llama2")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>"}  # fmt: skip
    folders = []
    for name, template in (("plain", base), ("marked", base.replace(LLAMA2_REPLY, LLAMA2_MARKED))):
        out = tmp_path / name
        out.mkdir()
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": template})
        )
        folders.append(out)
    conv = Conventions.of(load_tokenizer(folders[0] / "tokenizer.json"), folders[0])
    ids, mask = conv.chat_targets(DIGITS)
    want = hf_tokenizer(folders[1]).apply_chat_template(
        DIGITS, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids == list(want["input_ids"])
    text = hf_tokenizer(folders[0]).apply_chat_template(DIGITS, tokenize=False)
    enc = tok.encode(text, add_special_tokens=False)
    assert enc.ids == ids
    spaces = [m.end() - 1 for m in re.finditer(r"\[/INST\] ", text)]
    lone = [i for i, (a, b) in enumerate(enc.offsets) if a in spaces and enc.tokens[i] == "▁"]
    assert len(lone) == 2  # the case at issue: the separator is a token of its own
    assert not any(mask[i] for i in lone) and all(mask[i + 1] for i in lone)
    assert mask == [bool(m) for m in want["assistant_masks"]]
