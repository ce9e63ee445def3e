"""minillm: a from-scratch, readable LLaMA-style LLM training toolkit."""

__version__ = "0.1.0"
