"""The model stage, math only: the Transformer, its CPU kernels, the KV cache and decoding.

`from minillm.model import Transformer, KVCache` is the stable entry (DESIGN.md's Python API);
`use_cpu_kernels(model)` is what a trainer calls to train faster on a CPU. Modules: `transformer`
(the modules, plain PyTorch), `kernels_cpu` (eager CPU autograd kernels and `use_cpu_kernels`),
`kv_cache`, `decode` (the decoding fast path, continuous batching), `inputs` (what forward derives
from its arguments: checks, positions, masks), `param_groups` (which optimizer trains which
parameter). Which published family a model is, and its names in other formats, are
minillm.families' (a stage above): nothing here imports it.
"""

from minillm.model.kernels_cpu import use_cpu_kernels
from minillm.model.kv_cache import KVCache
from minillm.model.transformer import Transformer

__all__ = ["KVCache", "Transformer", "use_cpu_kernels"]
