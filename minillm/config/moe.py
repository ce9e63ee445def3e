"""The keys of a mixture of experts (`model.n_experts` and the `moe_*` keys) and their checks.

`MoEKeys` is a part of `ModelConfig` (`minillm.config.schema`): its fields are model keys, its
checks run in `ModelConfig.__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from minillm.config.section import Section, setting


@dataclass
class MoEKeys(Section):
    """The mixture-of-experts keys; n_layer and the rest of ModelConfig's are read from self."""

    n_experts: int = setting(
        0,
        help="Experts in each block's FFN (a mixture of experts, as Mixtral): a linear router "
        "sends each token to n_experts_per_token of these SwiGLUs. 0 = the dense SwiGLU.",
    )
    n_experts_per_token: int = setting(
        2,
        help="Experts each token goes through (top-k of the router's softmax, their weights "
        "renormalised to sum to 1); at most n_experts.",
    )
    moe_ffn_hidden: int | None = setting(
        None, help="Each expert's SwiGLU hidden width. null = ffn_hidden (the dense width)."
    )
    moe_norm_topk: bool = setting(
        True,
        help="Renormalise each token's k router weights to sum to 1 (Mixtral, Qwen3-MoE); false "
        "keeps their softmax probabilities over all experts (Qwen1.5-MoE, Qwen2-MoE).",
    )
    moe_shared_ffn_hidden: int = setting(
        0,
        help="Width of a shared expert every token goes through beside its k (Qwen2-MoE): a "
        "SwiGLU whose output is scaled by sigmoid of a learned linear of the input. 0 = none.",
    )
    moe_dense_layers: list[int] = setting(
        [],
        help="Blocks (from 0) whose FFN is the dense SwiGLU of ffn_hidden instead of the "
        "experts (Qwen-MoE's mlp_only_layers and decoder_sparse_step).",
    )
    moe_router: Literal["softmax", "sigmoid"] = setting(
        "softmax",
        help="How the router scores the experts: softmax over them (Mixtral, Qwen-MoE), or "
        "sigmoid per expert (DeepSeek-V3): a routing bias, a buffer that train.moe_bias_update "
        "moves, is added to the scores for the choice only, the k weights are the unbiased "
        "scores (renormalised with moe_norm_topk, times moe_routed_scale) and the shared "
        "expert of moe_shared_ffn_hidden has no gate.",
    )
    moe_n_group: int = setting(
        1,
        help="Sigmoid router: the experts in this many equal groups, each scored by the sum of "
        "its two best biased scores; a token's k experts come from its moe_topk_group best "
        "groups (DeepSeek-V3's n_group). 1 = no grouping.",
    )
    moe_topk_group: int = setting(
        1,
        help="Sigmoid router: the groups (of moe_n_group) a token's experts may come from "
        "(DeepSeek-V3's topk_group).",
    )
    moe_routed_scale: float = setting(
        1.0,
        help="Sigmoid router: the k weights are multiplied by this (DeepSeek-V3's "
        "routed_scaling_factor, 2.5 there).",
    )

    def _check_moe(self) -> None:
        """The expert counts, the keys that need experts, then the router's keys."""
        self._positive("moe_ffn_hidden", "n_experts_per_token")
        self._non_negative("n_experts")
        if self.n_experts == 1:
            self._fail(
                "n_experts", "1 expert is the dense FFN behind a router: use 0 (dense) or >= 2"
            )
        if self.n_experts and self.n_experts_per_token > self.n_experts:
            self._fail(
                "n_experts_per_token",
                f"{self.n_experts_per_token} is more than n_experts={self.n_experts}",
            )
        self._non_negative("moe_shared_ffn_hidden")
        moe_options = {
            "moe_norm_topk": not self.moe_norm_topk,
            "moe_shared_ffn_hidden": self.moe_shared_ffn_hidden,
            "moe_dense_layers": self.moe_dense_layers,
        }
        for key, used in moe_options.items():
            if used and not self.n_experts:
                self._fail(key, f"{getattr(self, key)!r} needs a mixture of experts (n_experts)")
        bad = [i for i in self.moe_dense_layers if not 0 <= i < self.n_layer]
        if bad or len(set(self.moe_dense_layers)) != len(self.moe_dense_layers):
            self._fail(
                "moe_dense_layers",
                f"{self.moe_dense_layers}: block numbers must be distinct, from 0 to "
                f"n_layer - 1 = {self.n_layer - 1}",
            )
        if self.n_experts and len(self.moe_dense_layers) == self.n_layer:
            self._fail("moe_dense_layers", "every block dense: that is n_experts 0")
        self._check_router()

    def _check_router(self) -> None:
        """model.moe_router sigmoid and the keys only it reads (DeepSeek-V3's routing)."""
        if self.moe_router == "sigmoid" and not self.n_experts:
            self._fail("moe_router", "sigmoid needs a mixture of experts (n_experts)")
        self._positive("moe_n_group", "moe_topk_group", "moe_routed_scale")
        sigmoid_only = {
            "moe_n_group": self.moe_n_group != 1,
            "moe_topk_group": self.moe_topk_group != 1,
            "moe_routed_scale": self.moe_routed_scale != 1.0,
        }
        for key, used in sigmoid_only.items():
            if used and self.moe_router != "sigmoid":
                self._fail(key, f"{getattr(self, key)!r} needs model.moe_router sigmoid")
        G, E = self.moe_n_group, self.n_experts
        if G == 1:
            return
        if E % G or E // G < 2:
            self._fail(
                "moe_n_group",
                f"{G} groups of n_experts={E}: each group needs the same number of experts, "
                "at least 2 (a group is scored by its two best)",
            )
        if self.moe_topk_group > G:
            self._fail("moe_topk_group", f"{self.moe_topk_group} is more than moe_n_group={G}")
        if self.moe_topk_group * (E // G) < self.n_experts_per_token:
            self._fail(
                "moe_topk_group",
                f"{self.moe_topk_group} groups of {E // G} experts hold fewer than "
                f"n_experts_per_token={self.n_experts_per_token}",
            )
