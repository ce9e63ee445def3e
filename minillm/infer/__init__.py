"""The inference stage: everything that uses a trained model.

Modules: `generate` (the sampling loop with a KV cache, streaming, `minillm sample`), `sampling`
(the pure filters and seeds), `chat` (`minillm chat`), `evaluate` (loss, perplexity, bits per
byte: the one evaluation, also used by the trainer), `chat_eval` (its chat data), `task_format`
(task files, read and checked) and `task_scoring` (multiple-choice and exact-match scores).
"""
