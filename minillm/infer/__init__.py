"""The inference stage: everything that uses a trained model.

Modules: `generate` (the sampling loop with a KV cache, streaming, `minillm sample`), `sampling`
(the pure filters and seeds), `evaluate` (loss, perplexity, bits per byte: the one evaluation,
also used by the trainer), `hf_folder` (export to and import from a Hugging Face Llama folder).
"""
