"""The inference stage: everything that uses a trained model.

Modules: `engine` (the one decoding core), `text_stream` (text pieces from token ids),
`sampling` (the pure filters and seeds), `sample` (`minillm sample`), `conversation` (`minillm
chat`), `evaluate` (loss, perplexity, bits per byte: the one evaluation, also used by the
trainer), `evaluate_chat` (the evaluation of chat data, one conversation at a time),
`task_format` (task files, read and checked) and `task_scoring` (multiple-choice and exact-match
scores).
"""
