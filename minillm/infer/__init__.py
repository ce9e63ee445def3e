"""The inference stage: everything that uses a trained model.

Modules: `generate` (sampling with a KV cache, streaming), `evaluate` (loss, perplexity, bits per
byte: the one evaluation, also used by the trainer), `hf_folder` (export to and import from a
Hugging Face Llama folder).
"""
