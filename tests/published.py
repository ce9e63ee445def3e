"""Published models' folders, built in the test: a random-weight transformers model and a byte-level
BPE tokenizer (trained here with `tokenizers`) that carries a family's real special tokens, its
post-processor (Llama 3 and Mistral add their BOS), its chat template (written from the
families' documented formats), tokenizer_config.json and generation_config.json.

Families: `chatml` (Qwen2's ChatML), `chatml-marked` (the same with `{% generation %}` markers,
for transformers' assistant mask), `qwen2.5` (ChatML whose system prompt is a default),
`llama3` (headers and `<|eot_id|>`; two eos ids), `llama3-marked`, `mistral` (`[INST]`, the
reply ended by `</s>`). `family_folder(root, name)` writes one; `hf_tokenizer(folder)` is
transformers' AutoTokenizer of it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tests.helpers import EXTRA, SHAKESPEARE, spread_weights_

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_MARKED = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
LLAMA3_MARKED = (
    "{% for message in messages %}"
    "{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]

# name -> special tokens, tokenizer_config values, BOS the post-processor adds, template,
#         generation_config eos names
FAMILIES: dict[str, dict[str, Any]] = {
    "chatml": dict(specials=QWEN_SPECIALS, bos=None, template=CHATML,
                   config=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
                   eos=["<|im_end|>", "<|endoftext|>"]),
    "chatml-marked": dict(specials=QWEN_SPECIALS, bos=None, template=CHATML_MARKED,
                          config=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
                          eos=["<|im_end|>", "<|endoftext|>"]),
    "qwen2.5": dict(specials=QWEN_SPECIALS, bos=None, template=QWEN25,
                    config=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
                    eos=["<|im_end|>", "<|endoftext|>"]),
    "llama3": dict(specials=LLAMA3_SPECIALS, bos="<|begin_of_text|>", template=LLAMA3,
                   config=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
                   eos=["<|end_of_text|>", "<|eot_id|>"]),
    "llama3-marked": dict(specials=LLAMA3_SPECIALS, bos="<|begin_of_text|>",
                          template=LLAMA3_MARKED,
                          config=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
                          eos=["<|end_of_text|>", "<|eot_id|>"]),
    "mistral": dict(specials=MISTRAL_SPECIALS, bos="<s>", template=MISTRAL,
                    config=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
                    eos=["</s>"]),
}  # fmt: skip
VOCAB = 400


@functools.lru_cache(maxsize=8)
def _tokenizer_json(name: str) -> str:
    family = FAMILIES[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=family["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = SHAKESPEARE.read_text(encoding="utf-8")[:8000] + EXTRA * 3
    tok.train_from_iterator([text], trainer=trainer)
    bos = family["bos"]
    if bos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok.to_str()


def family_tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_str(_tokenizer_json(name))


def family_folder(
    root: Path, name: str, model_class: str = "LlamaForCausalLM", **config: Any
) -> Path:
    """A published model's folder of family `name`: transformers' `model_class` with random
    weights (spread wide), the family's tokenizer, template and generation config."""
    family = FAMILIES[name]
    folder = root / name
    tok = family_tokenizer(name)
    eos_ids = [tok.token_to_id(t) for t in family["eos"]]
    bos = family["bos"] or family["specials"][0]
    config_class = getattr(transformers, model_class.replace("ForCausalLM", "Config"))
    sizes = dict(vocab_size=VOCAB + 16, hidden_size=64, intermediate_size=96,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
    hf_cfg = config_class(
        **{**sizes, **config}, bos_token_id=tok.token_to_id(bos), eos_token_id=eos_ids
    )
    torch.manual_seed(3)
    model = spread_weights_(getattr(transformers, model_class)(hf_cfg).eval())
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.do_sample = False
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": family["template"],
        "model_max_length": 128,
        **family["config"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
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


def usable(name: str, messages: list[dict[str, str]]) -> bool:
    """Mistral's [INST] template has no system role."""
    return not (name == "mistral" and messages[0]["role"] == "system")
