"""The tokenizer stage: how every command turns text into token ids and back.

Modules: `bpe` (minillm's own byte-level BPE: train, save, load, check, its special tokens),
`pieces` (the kinds of published tokenizers minillm applies, byte-level and sentencepiece-style,
and the bytes a token spells), `chat_template` (minillm's own chat template, by token id),
`jinja_chat` (a published model's Jinja chat template, rendered as transformers renders it) and
`conventions` (one interface, `Conventions`, with one implementation per kind: own, published
byte-level, published sentencepiece; chosen once, by `Conventions.of`) and `companions` (the
files beside a tokenizer.json that carry a published model's conventions, and the special ids an
export writes).

The data stage (minillm.data: corpus -> shards), checkpoints and the server all read text through
this stage; checkpoints and the server never import minillm.data (pyproject.toml's import-linter
contracts).
"""
