"""The keys of DeepSeek's multi-head latent attention (`model.attention: mla`) and their checks.

`MLAKeys` is a part of `ModelConfig` (`minillm.config.schema`): its fields are model keys
(`model.kv_lora_rank`, ...), its checks run in `ModelConfig.__post_init__`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from minillm.config.section import Section, setting


@dataclass
class MLAKeys(Section):
    """model.attention and the MLA keys; the rest of ModelConfig's keys are read from self."""

    attention: Literal["gqa", "mla"] = setting(
        "gqa",
        help="gqa = multi-head attention with n_kv_head key/value heads (grouped-query when "
        "fewer than n_head); mla = DeepSeek's multi-head latent attention: keys and values "
        "up-projected from one kv_lora_rank latent per token, the KV cache holding that latent "
        "and a shared qk_rope_head_dim RoPE key (head_dim is then qk_rope_head_dim).",
    )
    q_lora_rank: int | None = setting(
        None,
        help="mla: queries through a q_lora_rank bottleneck (down-projection, RMSNorm, "
        "up-projection), as DeepSeek-V3; null = one plain query projection (V2-Lite).",
    )
    kv_lora_rank: int | None = setting(
        None, help="mla: width of the compressed key/value latent (DeepSeek-V3: 512). Needed."
    )
    qk_nope_head_dim: int | None = setting(
        None, help="mla: per-head query/key width without RoPE (DeepSeek-V3: 128). Needed."
    )
    qk_rope_head_dim: int | None = setting(
        None,
        help="mla: width of the rotated part of each query head and of the one RoPE key all "
        "heads share (DeepSeek-V3: 64); even. Needed.",
    )
    v_head_dim: int | None = setting(
        None, help="mla: per-head value width. null = qk_nope_head_dim."
    )

    def _check_mla(self) -> None:
        """model.attention mla and the keys only it reads; head_dim resolves to the RoPE width
        and n_kv_head to n_head, as transformers' DeepseekV3Config."""
        mla_keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
        self._positive(*mla_keys, "v_head_dim")
        if self.attention != "mla":
            for key in (*mla_keys, "v_head_dim"):
                if getattr(self, key) is not None:
                    self._fail(key, f"{getattr(self, key)!r} needs model.attention mla")
            return
        for key in mla_keys[1:]:
            if getattr(self, key) is None:
                self._fail(key, "needed by model.attention mla")
        if self.qk_rope_head_dim % 2:
            self._fail("qk_rope_head_dim", f"{self.qk_rope_head_dim} must be even for RoPE")
        if self.head_dim not in (None, self.qk_rope_head_dim):
            self._fail("head_dim", f"{self.head_dim}: with mla it is qk_rope_head_dim; leave null")
        if self.n_kv_head not in (None, self.n_head):
            self._fail("n_kv_head", f"{self.n_kv_head}: mla has no key/value heads; leave null")
        unused = {
            "attention_bias": self.attention_bias,
            "qk_norm": self.qk_norm,
            "sliding_window": self.sliding_window is not None,
            "query_pre_attn_scalar": self.query_pre_attn_scalar is not None,
            "partial_rotary": self.partial_rotary != 1.0,  # qk_rope_head_dim is the rotated part
        }
        for key, used in unused.items():
            if used:
                self._fail(key, f"{getattr(self, key)!r} is not built with model.attention mla")
        self.head_dim, self.n_kv_head = self.qk_rope_head_dim, self.n_head
        if self.v_head_dim is None:
            self.v_head_dim = self.qk_nope_head_dim

    @property
    def mla_softmax_scale(self) -> float:
        """mla's logit scale: (qk_nope_head_dim + qk_rope_head_dim)^-0.5, times yarn's
        mscale(factor, mscale_all_dim)^2 (transformers' yarn_apply_mscale)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        s = self.rope_scaling
        if s.type != "none" and s.mscale_all_dim and s.factor > 1:
            m = 0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0
            scale *= m * m
        return scale
