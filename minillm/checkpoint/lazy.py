"""Lazy loading: a model built without memory for its weights, then filled tensor by tensor.

Offers `LazySafetensors(files)` (a read-only Mapping over safetensors files that reads one
tensor, memory-mapped, when it is looked up), `empty_model(cfg)` (a Transformer whose
parameters are on the meta device: no memory, no init), `fill_model(model, tensors, where,
dtype, device)` (each parameter materialised once, in `dtype`, on `device`, from an iterable of
(our name, tensor); an optional `on_filled` hook may replace each module once its parameters
are all there: QLoRA's base becomes NF4 layer by layer so; `on_read` sees each tensor: the
base's sha256 computed as it is read), `by_group` (an adapter's tensors a block at a time in
sorted-name order, the order that digest needs), `release_freed_memory` / `map_large_blocks`
(glibc's heap gives freed blocks back), `stored_dtype` / `resolve_dtype` (what `--dtype auto`
means) and `DTYPES`, the names `--dtype` takes.

Why this shape: a published model's weights are as large as the host's memory allows, so no
step may hold them twice. A tensor read here is a view of the file's pages (the mapping lives as
long as the tensor); converting it to the run's dtype or moving it to the GPU copies it once and
lets the view go, and a tensor already in the run's dtype on the CPU becomes the parameter as it
is (a private, copy-on-write mapping: the file is never written). The errors for weights that do
not fit are `minillm.checkpoint.weights.fit_error`'s, as an eager load's.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch
import torch.nn as nn

from minillm.checkpoint.weights import fit_error
from minillm.errors import CheckpointError, UserError

# --dtype's names; "auto" is the weights' own (`stored_dtype`).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# safetensors' dtype names as torch's (LazySafetensors.meta).
_TORCH_NAMES = {
    "F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
# safetensors' dtype names of the float types a model computes in (DTYPES').
_SAFETENSORS_DTYPES = {k: DTYPES[v] for k, v in _TORCH_NAMES.items() if v in DTYPES}


def _unreadable(path: Path, e: Exception) -> CheckpointError:
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return CheckpointError(f"{path}: not a readable safetensors file ({reason})")


class LazySafetensors(Mapping[str, torch.Tensor]):
    """The tensors of safetensors `files` by name, each read (memory-mapped) on lookup.

    Only the files' headers are read here. Each lookup opens its file anew, so no mapping
    outlives the tensors taken from it: the pages read count as this process's memory only
    while a tensor holds them. A file that cannot be read is a CheckpointError naming it.
    """

    def __init__(self, files: Sequence[str | Path]) -> None:
        from safetensors import SafetensorError, safe_open

        self._file_of: dict[str, Path] = {}
        self._dtype_of: dict[str, str] = {}
        self._shape_of: dict[str, tuple[int, ...]] = {}
        for path in map(Path, files):
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        if key not in self._file_of:
                            self._file_of[key] = path
                            header = f.get_slice(key)
                            self._dtype_of[key] = header.get_dtype()
                            self._shape_of[key] = tuple(header.get_shape())
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise _unreadable(path, e) from None

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        path = self._file_of[key]  # a KeyError, as a dict's, for a name no file has
        try:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise _unreadable(path, e) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def __contains__(self, key: object) -> bool:
        return key in self._file_of

    def meta(self, key: str) -> torch.Tensor:
        """Tensor `key` on the meta device (its shape and dtype, from the header): no byte read.
        A KeyError for a name no file has or a dtype torch has not."""
        dtype = getattr(torch, _TORCH_NAMES.get(self._dtype_of[key], "-"), None)
        if not isinstance(dtype, torch.dtype):
            raise KeyError(key)
        return torch.empty(self._shape_of[key], dtype=dtype, device="meta")

    def float_dtype(self) -> torch.dtype | None:
        """The dtype most of the float tensors are stored in (by count), from the headers; None
        where none is a float32, bfloat16 or float16."""
        counts: dict[torch.dtype, int] = {}
        for name in self._dtype_of.values():
            if name in _SAFETENSORS_DTYPES:
                counts[_SAFETENSORS_DTYPES[name]] = counts.get(_SAFETENSORS_DTYPES[name], 0) + 1
        return max(counts, key=counts.__getitem__) if counts else None


class _Switched(Mapping[str, torch.Tensor]):
    """`src` whose lookups give meta tensors (no byte read) while `real` is False."""

    def __init__(self, src: LazySafetensors) -> None:
        self.src, self.real = src, False

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.src[key] if self.real else self.src.meta(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.src)

    def __len__(self) -> int:
        return len(self.src)

    def __contains__(self, key: object) -> bool:
        return key in self.src


def weight_group(name: str) -> str:
    """The group a weight is read in by by_group: its block (`blocks.<i>`), else itself."""
    return ".".join(name.split(".")[:2]) if name.startswith("blocks.") else name


def by_group(
    produce: Callable[[Mapping[str, torch.Tensor]], Iterator[tuple[str, torch.Tensor]]],
    src: LazySafetensors,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`produce(src)`'s (our name, tensor) pairs (a family's from_hf), a group (weight_group)
    at a time in the sorted order of the names: the order weights_sha256 hashes in, so a load
    hashes each tensor as it reads it (SortedDigest), holding at most one block. A folder's
    adapter yields blocks 0, 1, 2, ...; the sorted names go 0, 1, 10, 11, ..., 2.

    `produce` is run once on meta tensors (no byte read) for the names, then once per group, its
    lookups real only while it computes that group's tensors. Each tensor is read once. Where a
    dry run fails, or a group's tensor comes out meta (the adapter read it early), the pairs
    come in `produce`'s own order instead."""
    switched = _Switched(src)
    try:
        names = [name for name, _ in produce(switched)]
    except Exception:  # noqa: BLE001  the real pass below raises what is wrong, as it says it
        names = []
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(weight_group(name), []).append(i)
    done: set[str] = set()
    for group in sorted(groups):
        want, pairs, whole = set(groups[group]), produce(switched), True
        for i in range(max(want) + 1):
            switched.real = i in want
            name, t = next(pairs, ("", None))
            if i in want and (t is None or t.is_meta):
                whole = False  # not produced as the dry run said: the rest in produce's order
                break
            if i in want:
                yield name, t
                done.add(name)
            del t
        pairs.close()
        if not whole:
            break
    if len(done) < len(names) or not names:
        yield from ((name, t) for name, t in produce(src) if name not in done)


def resolve_dtype(name: str | torch.dtype | None, stored: torch.dtype | None) -> torch.dtype:
    """--dtype as a torch dtype: `auto` the weights' own (`stored`; float32 where unknown),
    None float32 (what a caller that names none has always had). A UserError names a value
    that is none of auto, float32, bfloat16, float16."""
    if isinstance(name, torch.dtype):
        return name
    if name is None:
        return torch.float32
    if name == "auto":
        return stored or torch.float32
    if name not in DTYPES:
        raise UserError(f"--dtype: {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def stored_dtype(hf_config: Mapping[str, object], tensors: LazySafetensors) -> torch.dtype:
    """What `--dtype auto` loads a Hugging Face folder in, as transformers does: config.json's
    `dtype` (`torch_dtype` before transformers 5) where it names a float type, else the dtype
    the weights are stored in, else float32."""
    for key in ("dtype", "torch_dtype"):
        value = hf_config.get(key)
        if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
            return DTYPES[value.removeprefix("torch.")]
    return tensors.float_dtype() or torch.float32


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device (no memory, its init a no-op);
    buffers (RoPE tables, which no checkpoint stores) are computed as usual. The allocation
    each layer makes before its weight is moved is never written, so it costs no memory. The
    initialisers are skipped: the first random fill of a meta tensor imports torch's meta
    kernels, ~170 MB of host memory for nothing."""
    register = nn.Module.register_parameter
    inits = {name: getattr(nn.init, name) for name in _INITS}

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    def skip(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return tensor

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    for name in _INITS:
        setattr(nn.init, name, skip)
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
        for name, init in inits.items():
            setattr(nn.init, name, init)


# What nn.Linear, nn.Embedding and Transformer.reset_parameters initialise with.
_INITS = ("normal_", "uniform_", "kaiming_uniform_", "ones_", "zeros_", "trunc_normal_")


def empty_model(cfg: object) -> nn.Module:
    """The Transformer of ModelConfig `cfg` with its parameters on the meta device, for
    `fill_model` (its buffers real, on the CPU)."""
    from minillm.model import Transformer

    with _parameters_on_meta():
        return Transformer(cfg)  # type: ignore[arg-type]


def fill_model(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    where: str,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    on_filled: Callable[[str, nn.Module], nn.Module | None] | None = None,
    on_read: Callable[[str, torch.Tensor], None] | None = None,
) -> nn.Module:
    """Materialise `model`'s parameters from (our name, tensor) pairs, one at a time: each in
    `dtype` on `device` (persistent buffers, a router's bias, keep their own dtype), then its
    other buffers moved to `device`; the model in eval mode. Names missing, unexpected or
    mis-shaped are one CheckpointError naming `where` (the message of an eager load).

    `on_filled(name, module)` is called once each module's own parameters are all materialised
    (a module without parameters: never); a module it returns replaces that one in its parent,
    so a layer can be converted (quantized) while the rest of the model is still being read.
    `on_read(name, value)` is given each tensor as materialised, before that (SortedDigest.add:
    the base's sha256 from the one read)."""
    device = torch.device(device)
    slots: dict[str, tuple[nn.Module, str, bool]] = {}
    # Per module with parameters: its name, its parent and attribute, its parameters unfilled.
    pending: dict[int, tuple[str, nn.Module | None, str, set[str]]] = {}
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for leaf, p in module._parameters.items():
            if p is not None:
                slots.setdefault(prefix + leaf, (module, leaf, True))
        own_params = {leaf for leaf, p in module._parameters.items() if p is not None}
        if on_filled is not None and own_params and id(module) not in pending:
            parent_name, _, attr = mod_name.rpartition(".")
            parent = model.get_submodule(parent_name) if mod_name else None
            pending[id(module)] = (mod_name, parent, attr, own_params)
        for leaf, b in module._buffers.items():
            if b is not None and leaf not in module._non_persistent_buffers_set:
                slots.setdefault(prefix + leaf, (module, leaf, False))
    own = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    given: dict[str, tuple[int, ...]] = {}
    for name, tensor in tensors:
        given[name] = tuple(tensor.shape)
        if name not in slots or given[name] != own[name]:
            continue  # reported below, with every other problem
        module, leaf, is_param = slots[name]
        old = module._parameters[leaf] if is_param else module._buffers[leaf]
        assert old is not None
        want = dtype if is_param and tensor.is_floating_point() else old.dtype
        value = tensor.to(device=device, dtype=want).contiguous()
        if is_param:
            module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
        else:
            module._buffers[leaf] = value
        if on_read is not None:
            on_read(name, value)
        del tensor, value  # the file's pages go with the last view of them
        replaced = is_param and id(module) in pending and _filled(pending, module, leaf, on_filled)
        if replaced:
            # Replaced: nothing here may keep the old module's float weights alive.
            prefix = name.removesuffix(leaf)
            for other in module._parameters:
                slots.pop(prefix + other, None)
        del module, old
        if replaced:
            release_freed_memory()
    error = fit_error(own, given, where)
    if error is not None:
        raise error
    for module in model.modules():
        for leaf, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[leaf] = b.to(device)
    return model.eval()


@cache
def _glibc(name: str) -> Callable[..., int] | None:
    try:
        return getattr(ctypes.CDLL(None), name)  # glibc's malloc_trim, mallopt
    except (OSError, AttributeError):
        return None


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
# The thresholds a LoRA run sets (minillm.train.run). `scripts/bench_scale.py --precision bf16
# --jobs lora --no-reference --info` on a 2-core AMD EPYC, glibc's MALLOC_MMAP_THRESHOLD_ set
# instead: a bf16 LoRA run at TinyLlama-1.1B's shape peaked at 3.34-3.58 GB over three runs with
# glibc's rising threshold, 3.31 twice at 4 MB; at Llama-3.2-3B's 9.23 against 8.19-8.21 GB, the
# step 24.2 against 23.3-24.4 s. 1 MB cost twice the step (its 1-4 MB temporaries each a fresh
# mapping, page faults and all); 4 MB did too at 3B (32 s) until bf16's upcast blocks came from a
# reused buffer (minillm.model.bf16_cpu). An fp32 LoRA run's peak (5.62 GB) did not move with
# 4 MB nor vary without, so it keeps glibc's own. QLoRA's 1 MB comes with its own reused buffer
# (minillm.model.nf4).
LORA_MMAP_THRESHOLD = 4 << 20
QLORA_MMAP_THRESHOLD = 1 << 20


def map_large_blocks(threshold: int = QLORA_MMAP_THRESHOLD) -> None:
    """Have glibc's malloc give each block of `threshold` bytes or more its own mapping, returned
    to the system when freed (elsewhere: nothing). Its default threshold rises to the largest
    block freed (up to 32 MB), and blocks under it are then carved from a heap whose freed parts
    it keeps: a TinyLlama-sized QLoRA step peaked ~560 MB higher so, its RSS after the step ~800
    MB higher. What LoRA and QLoRA runs set (LORA_MMAP_THRESHOLD's note: below some size the
    mappings' page faults cost time)."""
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, threshold)


def release_freed_memory() -> None:
    """Give the pages of the C heap's free blocks back to the system (glibc's malloc_trim;
    elsewhere nothing). glibc's mmap threshold rises as large blocks are freed, so a float
    layer freed after its NF4 conversion stays in the heap, carved up by the small NF4
    allocations that follow: ~700 MB kept of a TinyLlama-sized QLoRA load."""
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


def _filled(
    pending: dict[int, tuple[str, nn.Module | None, str, set[str]]],
    module: nn.Module,
    leaf: str,
    on_filled: Callable[[str, nn.Module], nn.Module | None] | None,
) -> bool:
    """Mark `module`'s parameter `leaf` filled; its last one calls `on_filled` (fill_model).
    Whether the module was replaced."""
    name, parent, attr, unfilled = pending[id(module)]
    unfilled.discard(leaf)
    if unfilled or on_filled is None:
        return False
    del pending[id(module)]
    new = on_filled(name, module)
    if new is None or new is module or parent is None:
        return False
    setattr(parent, attr, new)
    return True
