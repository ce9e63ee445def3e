"""RoPE's frequencies, plain and scaled (`model.rope_scaling`), and their cos/sin tables.

Offers `rope_tables`, `plain_frequencies`, `yarn_mscale`, `apply_rope`, `rotate_half_matrix`,
`rope_rotation` (plain RoPE in the "rotate half" layout of Hugging Face's Llama), `Rope` (RoPE
at one forward's positions, for every layer), `inv_frequencies(cfg, seq_len)`, `cos_sin` (the
tables of given positions) and `dynamic_rope`. For `model.rope_scaling` each type computes what
transformers' `ROPE_INIT_FUNCTIONS` compute for its `rope_type`, formula for formula and in the
same float32 order, so that logits match `LlamaForCausalLM` with that `rope_scaling`
(tests/test_rope_scaling.py compares the frequencies and attention factors):

- linear (position interpolation): every frequency divided by `factor`.
- dynamic (NTK-aware): the base grows with the sequence length L past the original length O,
  base * (factor L / O - (factor - 1)) ** (D / (D - 2)); plain RoPE up to O. The frequencies
  depend on L, so the model recomputes the tables per forward (`Transformer.rope`).
- yarn: per dimension a blend of the plain and the interpolated frequency, by how many turns it
  makes over O (beta_fast, beta_slow), and cos and sin scaled by the attention factor.
- llama3: wavelengths under O / high_freq_factor kept, over O / low_freq_factor divided by
  `factor`, a smooth blend between.
- longrope (Phi-3): each frequency divided by its short_factor, or by its long_factor for a
  sequence longer than O, and cos and sin scaled by the attention factor at every length. The
  long tables are precomputed beside the short ones; `longrope_rows` says which rows read them.

`model.partial_rotary` (Phi-4-mini) rotates only the first R = head_dim * partial_rotary
dimensions of HF's heads. Our heads hold those R as dimensions 0..R/2-1 and D/2..D/2+R/2-1 (the
pairs our "rotate half" rotates) and the unrotated ones between (`minillm.families.phi3` permutes
the q/k rows on import and export), so the frequencies are padded with zeros to D/2: angle 0
rotates nothing, exactly, and every RoPE path (training kernels, the decode step's matrices)
stays the full-head one.

Shape legend: D head dim, S positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from minillm.config import ModelConfig
from minillm.model.kv_cache import CacheWrite

Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # apply_rope's kind


def plain_frequencies(head_dim: int, base: float | torch.Tensor) -> torch.Tensor:
    """1 / base^(2i/D), i = 0 .. D/2 - 1; base a float, or (n, 1) bases giving (n, D/2)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base**exponents)


_plain = plain_frequencies


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 mscale ln(factor) + 1 (1 for factor <= 1), transformers' yarn_get_mscale."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    s, D, base = cfg.rope_scaling, cfg.rotary_dim, cfg.rope_theta
    attention = s.attention_factor
    if attention is None and s.mscale and s.mscale_all_dim:  # DeepSeek's ratio of the two
        attention = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    if attention is None:
        attention = yarn_mscale(s.factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        original = s.original_max_position_embeddings
        return (D * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001  # no division by zero, as transformers
    ramp = ((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, D, 2).float() / D)
    extrapolation = 1 - ramp  # 1 = keep the plain frequency, 0 = interpolate it
    inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention)


def _llama3(cfg: ModelConfig) -> torch.Tensor:
    s = cfg.rope_scaling
    inv_freq = _plain(cfg.rotary_dim, cfg.rope_theta)
    original = s.original_max_position_embeddings
    low_wavelen, high_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope(cfg: ModelConfig, long: bool) -> tuple[torch.Tensor, float]:
    s, R = cfg.rope_scaling, cfg.rotary_dim
    attention = s.attention_factor
    if attention is None:  # from factor, as transformers (Phi-3: max / original length)
        original = s.original_max_position_embeddings
        attention = math.sqrt(1 + math.log(s.factor) / math.log(original)) if s.factor > 1 else 1.0
    factors = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
    exponents = torch.arange(0, R, 2, dtype=torch.int64).float() / R
    return 1.0 / (factors * cfg.rope_theta**exponents), float(attention)


def inv_frequencies(
    cfg: ModelConfig, seq_len: int | torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies (D/2,) and the factor on cos and sin, for model `cfg`; with
    model.partial_rotary the unrotated dimensions' frequencies are 0.

    seq_len matters to dynamic and longrope only: the length of the sequence being read (an int,
    or for dynamic (n, 1) lengths, one per row, giving (n, D/2)); None or up to the original
    length: plain RoPE (longrope: its short factors).
    """
    inv_freq, scale = _rotary_frequencies(cfg, seq_len)
    pad = cfg.head_dim // 2 - inv_freq.shape[-1]
    if pad:
        inv_freq = torch.cat((inv_freq, inv_freq.new_zeros(*inv_freq.shape[:-1], pad)), dim=-1)
    return inv_freq, scale


def _rotary_frequencies(
    cfg: ModelConfig, seq_len: int | torch.Tensor | None
) -> tuple[torch.Tensor, float]:
    """inv_frequencies of the R rotated dimensions only, (R/2,) or (n, R/2)."""
    kind, s, R = cfg.rope_scaling.type, cfg.rope_scaling, cfg.rotary_dim
    if kind == "linear":
        return _plain(R, cfg.rope_theta) / s.factor, 1.0
    if kind == "yarn":
        return _yarn(cfg)
    if kind == "llama3":
        return _llama3(cfg), 1.0
    if kind == "longrope":
        original = s.original_max_position_embeddings
        return _longrope(cfg, seq_len is not None and int(seq_len) > original)
    if kind == "dynamic" and seq_len is not None:
        original = s.original_max_position_embeddings
        # The base in float64 then rounded, as transformers' Python float meets a float32 pow.
        length = torch.as_tensor(seq_len, dtype=torch.float64).clamp(min=original)
        base = cfg.rope_theta * ((s.factor * length / original) - (s.factor - 1)) ** (R / (R - 2))
        return _plain(R, base.float()), 1.0
    return _plain(R, cfg.rope_theta), 1.0


def cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions (..., S) times inv_freq (D/2,) or (..., 1, D/2), scaled by
    `scale` where the frequency is not 0 (model.partial_rotary's unrotated dimensions stay
    unscaled, as transformers scales its rotated ones only): (..., S, D) in the "rotate half"
    layout (the D/2 angles twice), float32."""
    angles = positions.float()[..., None] * inv_freq  # (..., S, D/2)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        rotated = torch.cat((inv_freq, inv_freq), dim=-1) != 0
        cos, sin = torch.where(rotated, cos * scale, cos), torch.where(rotated, sin * scale, sin)
    return cos, sin


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE angles, (max_len, D), in the "rotate half" layout (frequencies twice)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.int64).float(), inv_freq)  # (S, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (S, D)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of x (B, T, H, D) by cos/sin, (T, 1, D) or (B, T, 1, D).

    x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, in the tables' precision. The two halves of the
    tables are equal, so only the first is read. Returns a new contiguous tensor.
    """
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotate_half_matrix(head_dim: int) -> torch.Tensor:
    """The (D, D) matrix P with x @ P = [-x2, x1], HF's rotate_half(x), for x = [x1, x2]."""
    half = head_dim // 2
    i = torch.arange(half)
    p = torch.zeros(head_dim, head_dim)
    p[i + half, i] = -1.0
    p[i, i + half] = 1.0
    return p


def rope_rotation(cos: torch.Tensor, sin: torch.Tensor, rotate_half: torch.Tensor) -> torch.Tensor:
    """The matrices R (..., D, D) with x @ R == apply_rope(x, cos, sin) at one position per row.

    apply_rope(x) = x cos + rotate_half(x) sin = x @ (diag(cos) + P diag(sin)), P the
    `rotate_half_matrix`; cos, sin (..., D) are table rows. Decoding rotates all q and k heads of
    a token with this one small matmul instead of apply_rope's elementwise ops.
    """
    return torch.diag_embed(cos).addcmul_(rotate_half, sin[..., None, :])


class Rope:
    """RoPE at one forward's positions, for every layer: `rope(qk)` rotates the new tokens' q
    and k heads (B, T, heads, D) by cos/sin (T, 1, D) or (B, T, 1, D)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, rotate: Rotate) -> None:
        self.cos, self.sin, self.rotate = cos, sin, rotate

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.rotate(x, self.cos, self.sin)


def longrope_rows(
    cfg: ModelConfig, positions: slice | torch.Tensor, write: CacheWrite | None
) -> bool | torch.Tensor:
    """Which rows read longrope's long factors: those whose sequence is longer than the original
    length, as transformers picks them from max(position_ids) + 1, here per row (each row as it
    would be alone). True or False for every row, or (B,) bools. Without a KV cache a row's
    length is its largest position + 1; with one, its length after this write (a row that
    crosses the original length with keys cached is refilled first, `Transformer.forward`, so
    its cached keys are the long ones too)."""
    original = cfg.rope_scaling.original_max_position_embeddings
    if write is not None:
        lengths = torch.tensor(write.starts) + write.T
    elif isinstance(positions, slice):
        return positions.stop > original
    else:
        lengths = positions.amax(dim=-1) + 1  # (B,) or (1,)
    long = lengths > original
    if bool(long.all()):
        return True
    return long if bool(long.any()) else False


def dynamic_rope(
    cfg: ModelConfig,
    positions: slice | torch.Tensor,
    write: CacheWrite | None,
    rotate: Rotate,
    device: torch.device,
) -> Rope | None:
    """Dynamic NTK: the frequencies of the sequence's length L, as transformers computes them
    from max(position_ids) + 1; None (the plain tables) while L is at most the original length.
    Without a KV cache one L for the forward (its largest position + 1); with one, each row's
    own (its length after this write: past the original length a row is refilled from position
    0, `Transformer.forward`, so its L covers all of its tokens)."""
    original = cfg.rope_scaling.original_max_position_embeddings
    if write is None:
        L = positions.stop if isinstance(positions, slice) else int(positions.max()) + 1
        if L <= original:
            return None
        cos, sin = cos_sin(inv_frequencies(cfg, L)[0].to(device), torch.arange(L, device=device))
        return Rope(cos[positions][..., None, :], sin[positions][..., None, :], rotate)
    lengths = torch.tensor(write.starts)[:, None] + write.T  # (n, 1)
    if int(lengths.max()) <= original:
        return None
    inv_freq = inv_frequencies(cfg, lengths)[0].to(device)[:, None]  # (n, 1, D/2)
    cos, sin = cos_sin(inv_freq, torch.arange(write.end, device=device))  # (n, S, D)
    if isinstance(positions, slice):
        cos, sin = cos[:, positions], sin[:, positions]
    else:  # (n, T) positions of rows at different lengths
        rows = torch.arange(write.n, device=device)[:, None]
        cos, sin = cos[rows, positions], sin[rows, positions]
    return Rope(cos[..., None, :], sin[..., None, :], rotate)
