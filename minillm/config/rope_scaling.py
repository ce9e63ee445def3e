"""model.rope_scaling: how RoPE is stretched past the length a model was trained at.

Offers `RopeScalingConfig` (the nested section, with its checks) and `ROPE_SCALING_TYPES`;
`minillm.model.rope` computes each type as transformers' ROPE_INIT_FUNCTIONS does.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from minillm.config.section import Section, setting

# model.rope_scaling.type: how RoPE is stretched past the length a model was trained at
# (minillm.model.rope computes each as transformers' ROPE_INIT_FUNCTIONS does).
ROPE_SCALING_TYPES = ("none", "linear", "dynamic", "yarn", "llama3", "longrope")


@dataclass
class RopeScalingConfig(Section):
    """RoPE scaling: frequencies stretched so that a model reads past its trained length."""

    _section: typing.ClassVar[str] = "model.rope_scaling"

    type: Literal["none", "linear", "dynamic", "yarn", "llama3", "longrope"] = setting(
        "none",
        help="none = plain RoPE; linear = position interpolation (every frequency / factor); "
        "dynamic = NTK-aware base that grows with the sequence length past "
        "original_max_position_embeddings; yarn = YaRN (NTK-by-parts and an attention factor); "
        "llama3 = Llama 3.1's per-band frequency scaling; longrope = Phi-3's LongRoPE (each "
        "frequency divided by its short_factor, or its long_factor for a sequence longer than "
        "original_max_position_embeddings). As transformers' rope_type.",
    )
    factor: float = setting(1.0, help="Context extension factor (new length / original).")
    original_max_position_embeddings: int | None = setting(
        None,
        help="The context the model was trained at: where yarn's and llama3's bands are "
        "measured, past which dynamic starts to scale and longrope takes its long_factor. "
        "Needed by dynamic, yarn, llama3 and longrope.",
    )
    attention_factor: float | None = setting(
        None,
        help="yarn and longrope: scale of cos and sin (so of the attention logits, squared). "
        "null = 0.1 ln(factor) + 1 for yarn, as the YaRN paper and transformers; "
        "sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) for longrope, as "
        "LongRoPE and transformers (1 where factor is 1).",
    )
    beta_fast: float = setting(32.0, help="yarn: rotations where the frequencies stay unscaled.")
    beta_slow: float = setting(1.0, help="yarn: rotations where they are fully interpolated.")
    truncate: bool = setting(
        True, help="yarn: round the correction range to whole dimensions (transformers' default)."
    )
    mscale: float | None = setting(
        None,
        help="yarn (DeepSeek): with mscale_all_dim and no attention_factor, the attention factor "
        "is (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1), as transformers.",
    )
    mscale_all_dim: float | None = setting(
        None,
        help="yarn (DeepSeek): see mscale; with model.attention mla the softmax scale is also "
        "multiplied by (0.1 mscale_all_dim ln(factor) + 1)^2, as DeepSeek's attention.",
    )
    low_freq_factor: float = setting(1.0, help="llama3: wavelengths past original / this scale.")
    high_freq_factor: float = setting(
        4.0, help="llama3: wavelengths under original / this stay; between, a smooth blend."
    )
    short_factor: list[float] = setting(
        [],
        help="longrope: what each of the rotated dimensions' frequencies is divided by while "
        "the sequence is at most original_max_position_embeddings long (one per frequency: "
        "head_dim * partial_rotary / 2 of them).",
    )
    long_factor: list[float] = setting(
        [], help="longrope: the same for a sequence longer than original_max_position_embeddings."
    )

    def __post_init__(self) -> None:
        if self.type == "none":
            return
        if not self.factor >= 1.0:
            self._fail("factor", f"must be >= 1 with type {self.type}, got {self.factor}")
        self._positive("original_max_position_embeddings", "attention_factor")
        self._positive("mscale", "mscale_all_dim")
        for key in ("mscale", "mscale_all_dim"):
            if getattr(self, key) is not None and self.type != "yarn":
                self._fail(key, f"is yarn's: not used with type {self.type}")
        self._positive("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor")
        needs_original = self.type in ("dynamic", "yarn", "llama3", "longrope")
        if needs_original and self.original_max_position_embeddings is None:
            self._fail(
                "original_max_position_embeddings",
                f"type {self.type} needs the length the model was trained at",
            )
        if self.type == "longrope":
            for key in ("short_factor", "long_factor"):
                factors = getattr(self, key)
                if not factors or not all(f > 0 for f in factors):
                    self._fail(
                        key, f"longrope needs positive factors, one a frequency: {factors!r}"
                    )
        for key in ("short_factor", "long_factor"):
            if getattr(self, key) and self.type != "longrope":
                self._fail(key, f"is read by type longrope only (type is {self.type})")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            self._fail(
                "high_freq_factor",
                f"{self.high_freq_factor} must exceed low_freq_factor={self.low_freq_factor}",
            )
