"""The data stage: corpus -> text pieces -> BPE tokenizer -> token shards -> batches.

Modules: `sources` (resolving `data.source` to files or a hub dataset, loaded or streamed through
`datasets`), `corpus` (their documents, a prefix of them, and the split; `table` for rows),
`text` (splitting text into pieces; the tokenizer itself is minillm.tokenizer),
`tokenizer_train` (training one on a corpus or a sample of it),
`tokenize_pass` (the pass that `minillm tokenize` runs, with `encode_batches` for batching text
and conversations, `encode_pool` for encoding on a thread or in worker processes, `shard_writer`
for numbered shard files, `shard_staging` for checkpoints and resume, `summary` for its table),
`meta` (the shard format, meta.json and opening a split, checked by sha256), `shard_reader`
(several shards read as one array), `batches` (what the trainer and evaluation read).
"""
