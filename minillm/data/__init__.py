"""The data stage: corpus -> text pieces -> BPE tokenizer -> token shards -> batches.

Modules: `sources` (resolving `data.source` to files or a hub dataset, loaded or streamed through
`datasets`), `corpus` (their documents, a prefix of them, and the split; `table` for rows),
`text` (splitting text into pieces), `tokenizer` (the byte-level BPE and its special tokens),
`tokenizer_train` (training it on a corpus or a sample of it), `chat` (the chat template),
`shard_writer` (the pass that `minillm tokenize` runs, with `encode_pool` for encoding on a thread
or in worker processes, `chat_encode` for conversations, `shard_staging` for numbered shard files,
checkpoints and resume, `summary` for its table), `meta` (the shard format, meta.json and opening a
split, checked by sha256), `shard_reader` (several shards read as one array), `batches` (what the
trainer and evaluation read).
"""
