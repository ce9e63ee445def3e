"""Write a stand-in for a published model's Hugging Face folder: what a user would download, built
here (nothing can be downloaded in tests, CI or the demos).

    python scripts/make_published_folder.py models/standin-chatml --family chatml

A transformers model with random weights (the family's own class where it names one:
Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, Gemma3ForCausalLM, DeepseekV3ForCausalLM; else
Qwen2ForCausalLM for the ChatML families, else LlamaForCausalLM), saved by transformers, and a
byte-level BPE tokenizer trained with `tokenizers` on the shipped text that carries the family's
real special tokens, its post-processor
(Llama 3 and Mistral add their BOS), its chat template (written from the families' documented
formats), tokenizer_config.json and generation_config.json (Llama 3: two eos ids). Families:
`chatml` (Qwen2's ChatML), `chatml-marked` (the same with `{% generation %}` markers, for
transformers' assistant mask), `qwen2.5` (ChatML whose system prompt is a default), `llama3`
(headers and `<|eot_id|>`), `llama3-marked`, `mistral` (`[INST]`, the reply ended by `</s>`),
`gemma3` (`<start_of_turn>user` / `model` turns ended by `<end_of_turn>`, a system prompt prepended
to the first user turn; a Gemma3ForCausalLM with local and global layers), `deepseek-v3`
(`<｜User｜>` / `<｜Assistant｜>` turns, each reply ended by `<｜end▁of▁sentence｜>`; a
DeepseekV3ForCausalLM: latent attention, a dense block then DeepSeekMoE), and two MoE model
families with their tokenizers: `qwen1.5-moe` (Qwen1.5-MoE-A2.7B-Chat: its ChatML with a default
system prompt, a Qwen2MoeForCausalLM) and `qwen3-moe` (Qwen3-30B-A3B: Qwen3's template, whose last
reply carries a `<think>` block and whose earlier replies lose theirs; `<think>` and `</think>`
added tokens that are not special, as Qwen's; a Qwen3MoeForCausalLM).

The tokenizer splits text with GPT-2's byte-level regex unless `--split` names a published
model's own pre-tokenizer, written as its tokenizer.json has it: `qwen2` (an NFC normalizer and
Qwen2's Split regex, one digit per piece), `llama3` (Llama 3's Split regex, up to three digits per
piece, and `ignore_merges`), `smollm` (each digit alone, then GPT-2's regex).

The tests build their folders with `build` (tests/published.py); `make published-demo`
(README, "Fine-tune a published model") fine-tunes one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TEXTS = (ROOT / "data" / "tinyshakespeare.txt", ROOT / "data" / "tiny_chat.jsonl")
EXTRA = "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🙂🚀, Ελληνικά.\n"
# Trained on too with a published model's split: digit runs, contractions and whitespace runs
# often enough that the vocabulary has tokens one split makes and another does not.
SPLIT_EXTRA = (
    "In 2024, 1999 and 365 days; it's 10:30, don't, you've, they'll, I'M, O'Neil's 123456789 "
    "0042 3.14159 (x2024y)\n\n\n    indented\t\ttabs  two  spaces,word.Word!?\r\n 2024 — "
    "Grüße 2024 東京2024 🙂2024\n"
)

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
# Gemma 3's (google/gemma-3-1b-it), less its image branch: the system prompt opens the first
# user turn, the assistant's role is `model`, each content trimmed.
GEMMA3 = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# Qwen1.5-MoE-A2.7B-Chat's: ChatML, "You are a helpful assistant." where no system turn leads.
QWEN15 = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen3's (the tool-calling branches left out): a reply after the last user turn keeps its
# reasoning in a <think> block (the last one always has one), earlier replies lose theirs;
# enable_thinking=false opens the reply with an empty block.
QWEN3 = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string"
    " and not(message.content.startswith('<tool_response>')"
    " and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\n')"
    ".split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n')"
    " + '\n</think>\n\n' + content.lstrip('\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)
# Llama 2's chat format (its tokenizer_config.json's template): the system prompt in <<SYS>> inside
# the first user turn, each user turn after the BOS, each reply ended by the eos.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# DeepSeek-V3's format (its tokenizer_config.json's template, without the tool-call branches): the
# system prompts joined after the BOS, each user turn after <｜User｜>, each reply after
# <｜Assistant｜> and ended by the eos <｜end▁of▁sentence｜>.
DEEPSEEK_V3 = (
    "{% if not add_generation_prompt is defined %}"
    "{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{%- endif %}"
    "{%- endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
GEMMA3_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
DEEPSEEK_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                     "<｜Assistant｜>"]  # fmt: skip

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
    "gemma3": dict(specials=GEMMA3_SPECIALS, bos="<bos>", template=GEMMA3,
                   config=dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                               unk_token="<unk>"),
                   eos=["<eos>", "<end_of_turn>"]),
    "deepseek-v3": dict(specials=DEEPSEEK_SPECIALS, bos="<｜begin▁of▁sentence｜>",
                        template=DEEPSEEK_V3,
                        config=dict(bos_token="<｜begin▁of▁sentence｜>",
                                    eos_token="<｜end▁of▁sentence｜>",
                                    pad_token="<｜end▁of▁sentence｜>"),
                        eos=["<｜end▁of▁sentence｜>"]),
    # Sentencepiece-style tokenizers (`spm`): Llama 2's (a normalizer puts "▁" for spaces and
    # before the text, the decoder strips it) and Mistral v0.3's (a Metaspace pre-tokenizer).
    "llama2": dict(specials=SPM_SPECIALS, bos="<s>", template=LLAMA2, spm="normalizer",
                   config=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
                   eos=["</s>"]),
    "mistral-spm": dict(specials=MISTRAL_SPECIALS, bos="<s>", template=MISTRAL, spm="metaspace",
                        config=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
                        eos=["</s>"]),
    # Model families: their tokenizer's and their architecture's (model: class and the keys
    # of config.json beside the shape's; every block sparse, as the published ones).
    "qwen1.5-moe": dict(specials=QWEN_SPECIALS, bos=None, template=QWEN15,
                        config=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
                        eos=["<|im_end|>", "<|endoftext|>"],
                        model=("Qwen2MoeForCausalLM", dict(
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, norm_topk_prob=False))),
    "qwen3-moe": dict(specials=QWEN_SPECIALS, added=["<think>", "</think>"], bos=None,
                      template=QWEN3,
                      config=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
                      eos=["<|im_end|>", "<|endoftext|>"],
                      model=("Qwen3MoeForCausalLM", dict(
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          head_dim=16, norm_topk_prob=True))),
}  # fmt: skip
# A model class's own config values where the shapes are not all it needs: Gemma 3's head_dim
# is 256 unless set, and its layers alternate local (a window of 16) and global.
MODEL_VALUES: dict[str, dict[str, Any]] = {
    "Gemma3ForCausalLM": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                              sliding_window_pattern=2, rope_local_base_freq=10000.0),
    # MLA (a q bottleneck), block 0 dense, then DeepSeekMoE: 4 experts in 2 groups, top-2 from
    # the best group, one shared expert; yarn with DeepSeek's mscale keys.
    "DeepseekV3ForCausalLM": dict(
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
        rope_parameters=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64,
                             mscale=1.0, mscale_all_dim=1.0, rope_theta=10000.0)),
}  # fmt: skip
CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}
# Model shapes: `tiny` for the tests, `small` (about 2M parameters) for the demo.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "small": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
}  # fmt: skip


# The regexes of Qwen2's and Llama 3's tokenizer.json (their `pre_tokenizer`'s Split pattern).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = ("gpt2", "qwen2", "llama3", "smollm")


def _split(tok: Any, split: str) -> None:
    """Give `tok` the normalizer and pre-tokenizer of `split` (one of SPLITS)."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    regex = {"qwen2": QWEN2_SPLIT, "llama3": LLAMA3_SPLIT}.get(split)
    if split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )  # fmt: skip
    elif regex is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
             pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                      use_regex=False)]
        )  # fmt: skip
    else:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    if split == "qwen2":
        tok.normalizer = normalizers.NFC()


def _byte_chars() -> list[str]:
    """GPT-2's byte -> character table (byte b is the b-th), the one ByteLevel maps bytes with:
    printable Latin-1 bytes stand for themselves, the others for U+0100 on, in order."""
    kept = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(0x100, 0x200))
    return [chr(b) if b in kept else chr(next(others)) for b in range(256)]


def tokenizer_json(
    name: str, vocab_size: int, text_chars: int, split: str = "gpt2", without: tuple[int, ...] = ()
) -> str:
    """The family's BPE (byte-level, or sentencepiece-style for `spm` families: then `split` and
    `without` do not apply), trained on the first `text_chars` of the shipped texts,
    splitting text as `split` (one of SPLITS) does, without the tokens of the bytes `without`
    (as published vocabularies whose training text never held them)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    family = FAMILIES[name]
    if "spm" in family:
        return _sentencepiece_json(name, vocab_size, text_chars)
    lacking = [_byte_chars()[b] for b in without]
    tok = Tokenizer(models.BPE(ignore_merges=split == "llama3"))  # Llama 3's takes a word whole
    _split(tok, split)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=family["specials"],
        initial_alphabet=sorted(set(pre_tokenizers.ByteLevel.alphabet()) - set(lacking)),
        show_progress=False,
    )
    text = "".join(p.read_text(encoding="utf-8")[:text_chars] for p in TEXTS) + EXTRA * 3
    text += SPLIT_EXTRA * 30 if split != "gpt2" else ""
    tok.train_from_iterator([text], trainer=trainer)
    if any(char in tok.get_vocab() for char in lacking):
        raise ValueError(f"the shipped texts hold one of the bytes {without}")
    if family.get("added"):  # Qwen3's <think> and </think>: added tokens, not special ones
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family["added"]])
    bos = family["bos"]
    if bos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = tok.token_to_id(bos)
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
        # Llama 3's tokenizer.json chains ByteLevel (offsets) and the template; Mistral's has
        # the template alone.
        tok.post_processor = (
            processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
            if name.startswith("llama3")
            else template
        )
    return tok.to_str()


def _sentencepiece_json(name: str, vocab_size: int, text_chars: int) -> str:
    """A sentencepiece-style BPE as Llama 2's and Mistral's tokenizer.json hold it: the specials
    first, then the 256 byte-fallback tokens <0x00>..<0xFF> (ordinary vocabulary, not added
    tokens), then the learned pieces, "▁" for a space; the BOS added by the post-processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    family = FAMILIES[name]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*family["specials"], *byte_tokens],
        show_progress=False,
    )
    text = "".join(p.read_text(encoding="utf-8")[:text_chars] for p in TEXTS)
    tok.train_from_iterator([text], trainer=trainer)
    spec = json.loads(tok.to_str())
    # The byte tokens are vocabulary, not added tokens (as in the published files).
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in byte_tokens]
    space, bos = "\u2581", family["bos"]
    replace_space = {"type": "Replace", "pattern": {"String": space}, "content": " "}
    fallback = [replace_space, {"type": "ByteFallback"}, {"type": "Fuse"}]
    if family["spm"] == "normalizer":  # Llama 2, TinyLlama, Mistral v0.1
        spec["normalizer"] = {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": space},
                {"type": "Replace", "pattern": {"String": " "}, "content": space},
            ],
        }
        spec["pre_tokenizer"] = None
    else:  # Mistral v0.3: no normalizer, Metaspace puts the first "▁"
        spec["pre_tokenizer"] = {
            "type": "Metaspace",
            "replacement": space,
            "prepend_scheme": "first",
            "split": False,
        }
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [*fallback, {"type": "Strip", "content": " ", "start": 1, "stop": 0}],
    }
    out = Tokenizer.from_str(json.dumps(spec))
    bos_id = out.token_to_id(bos)
    out.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    return out.to_str()


def build(
    folder: Path,
    name: str,
    tokenizer: str,
    model_class: str | None = None,
    shape: str = "tiny",
    seed: int = 3,
    **config: Any,
) -> Path:
    """Write family `name`'s folder: `tokenizer` (tokenizer.json text), a random-weight
    transformers `model_class` (default: Qwen2 for ChatML, else Llama) of `shape`, the family's
    tokenizer_config.json (template, bos/eos/pad) and generation_config.json (eos ids, greedy)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    family = FAMILIES[name]
    family_class, family_config = family.get("model", (None, {}))
    model_class = (
        model_class
        or family_class
        or ("Qwen2ForCausalLM" if name.startswith(("chatml", "qwen")) else None)
        or {"gemma3": "Gemma3ForCausalLM", "deepseek-v3": "DeepseekV3ForCausalLM"}.get(name)
        or "LlamaForCausalLM"
    )
    if model_class == family_class:
        config = {**family_config, **config}
    tok = Tokenizer.from_str(tokenizer)
    eos_ids = [tok.token_to_id(t) for t in family["eos"]]
    bos = family["bos"] or family["specials"][0]
    config_name = CONFIG_CLASSES.get(model_class, model_class.replace("ForCausalLM", "Config"))
    config_class = getattr(transformers, config_name)
    values = dict(vocab_size=tok.get_vocab_size() + 16, tie_word_embeddings=False,
                  **{**SHAPES[shape], **MODEL_VALUES.get(model_class, {})})  # fmt: skip
    hf_cfg = config_class(
        **{**values, **config}, bos_token_id=tok.token_to_id(bos), eos_token_id=eos_ids
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(hf_cfg).eval()
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.do_sample = False
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": family["template"],
        "model_max_length": hf_cfg.max_position_embeddings,
        **family["config"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write (must not exist)")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="chatml")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--split", choices=SPLITS, default="gpt2",
                        help="the pre-tokenizer: GPT-2's regex or a published model's")  # fmt: skip
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out}: exists; a published model's folder is never overwritten")
    tokenizer = tokenizer_json(args.family, args.vocab_size, 200_000, args.split)
    build(args.out, args.family, tokenizer, shape=args.shape)
    print(f"wrote {args.out} ({args.family}, {args.shape})")


if __name__ == "__main__":
    main()
