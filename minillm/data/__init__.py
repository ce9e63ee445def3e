"""The data stage: corpus -> text pieces -> BPE tokenizer -> token shards -> batches.

Modules: `corpus` (loading files or a hub dataset through `datasets`), `text` (splitting text into
pieces), `tokenizer` (the byte-level BPE and its special tokens), `chat` (the chat template),
`shards` (the writer that `minillm tokenize` runs, with `chat_shards` for conversations), `meta`
(meta.json and opening a split), `batches` (what the trainer and evaluation read).
"""
