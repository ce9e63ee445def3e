"""The model stage: the Transformer, its CPU kernels, the KV cache and decoding, HF names.

`from minillm.model import Transformer, KVCache` is the stable entry (DESIGN.md's Python API).
Modules: `transformer` (the modules), `kernels_cpu` (eager CPU autograd kernels), `kv_cache`,
`decode` (the decoding fast path), `inputs` (forward's argument checks), `hf_names` (our
parameter names <-> Hugging Face Llama's), `param_groups` (which optimizer trains which parameter).
"""

from minillm.model.kv_cache import KVCache
from minillm.model.transformer import Transformer

__all__ = ["KVCache", "Transformer"]
