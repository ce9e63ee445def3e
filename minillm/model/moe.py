"""The mixture-of-experts FFN (`model.n_experts` > 0): SwiGLU experts routed per token, as Mixtral.

Offers `swiglu`, `MoE`, `SharedExpert`, `route`, `route_sigmoid`, `moe_reference`, `moe_dispatch`
(`expert_ffns` and `dispatch_experts`, which an int8 MoE shares), `RouterStats`,
`router_stats(model)`, `load_balancing_loss(stats, n_experts)` and, for the sigmoid router,
`biased_moes`, `update_router_bias` and `router_bias_scalars`. `swiglu` is also the dense FFN's
activation: it is defined once, here, because `minillm.model.transformer` imports this module
(not the other way round).

A linear router scores the E experts of each token; softmax over experts, the top k kept, their
weights renormalised to sum to 1 (Mixtral; HF's `MixtralSparseMoeBlock`) or, with
model.moe_norm_topk false, left as softmax probabilities (Qwen1.5-MoE's `norm_topk_prob`); the
output is the weighted sum of those k experts' SwiGLU outputs, plus, with
model.moe_shared_ffn_hidden, a shared expert every token goes through, scaled by
sigmoid(x . w_gate) (HF's `Qwen2MoeSparseMoeBlock`; Qwen3-MoE's block is Mixtral's with or without
the renormalisation). With model.moe_router sigmoid the routing is DeepSeek-V3's
(`route_sigmoid`; HF's `DeepseekV3MoE`): sigmoid scores, a routing bias for the choice only,
group-limited choice, weights times model.moe_routed_scale and an ungated shared expert; the
bias is a buffer that `update_router_bias` moves after each optimizer step
(train.moe_bias_update; docs/architecture.md derives both). Dropless: every token reaches its k
experts, however many tokens pick the same one (no capacity factor). `moe_reference` computes it
plainly (every expert on every token, zero weights on the others); `moe_dispatch`, which the
module runs, sorts the (token, expert) pairs by expert and makes one pair of matmuls per expert, so
each token costs k experts, not E (tests/test_moe.py pins the two together).

Shape legend: N tokens (B*T), C model dim, E experts, k experts per token, F expert hidden dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.config import ModelConfig
from minillm.model.bf16_cpu import linear


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused projection [gate, up] (..., 2F) -> (..., F)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def route(
    x: torch.Tensor, router: torch.Tensor, k: int, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router probabilities (N, E) in float32, and each token's k experts (N, k) with their
    weights (N, k), renormalised over the k unless `normalize` is False, for tokens x (N, C) and
    router weight (E, C)."""
    probs = linear(x, router).float().softmax(dim=-1)  # (N, E)
    weights, experts = probs.topk(k, dim=-1)  # (N, k) each, the most likely first
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, experts


def route_sigmoid(
    x: torch.Tensor,
    router: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    groups: tuple[int, int] = (1, 1),
    normalize: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (HF's `DeepseekV3TopkRouter`) of tokens x (N, C): the sigmoid
    scores (N, E) in float32, each token's k experts (N, k) chosen by score + bias (E,) among the
    experts of its `groups` = (G, g) best groups of G, and their weights (N, k): the unbiased
    scores, renormalised unless `normalize` is False, times `scale`."""
    scores = F.linear(x.float(), router.float()).sigmoid()  # (N, E)
    choice = scores + bias  # the bias decides who is chosen, never how much they weigh
    G, keep = groups
    if keep < G:  # group-limited: a group's score is the sum of its two best
        N, E = choice.shape
        grouped = choice.view(N, G, E // G)
        best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(keep, dim=-1).indices  # (N, g)
        dropped = torch.ones(N, G, dtype=torch.bool, device=x.device).scatter(1, best, False)
        choice = grouped.masked_fill(dropped[..., None], float("-inf")).view(N, E)
    experts = choice.topk(k, dim=-1).indices  # (N, k)
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return scores, weights * scale, experts


def moe_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """sum_e gate_e(x) * expert_e(x) over all E experts, gate_e zero unless e is chosen: the
    definition, at E/k times the cost. x (N, C), weights/experts (N, k), w_gate_up (E, 2F, C),
    w_down (E, C, F) -> (N, C)."""
    gates = torch.zeros(x.shape[0], w_gate_up.shape[0], dtype=weights.dtype, device=x.device)
    gates = gates.scatter(1, experts, weights)  # (N, E)
    y = torch.zeros_like(x)
    for e in range(w_gate_up.shape[0]):
        out = F.linear(swiglu(F.linear(x, w_gate_up[e])), w_down[e])  # (N, C)
        y = y + (out * gates[:, e, None]).to(x.dtype)
    return y


def moe_dispatch(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
) -> torch.Tensor:
    """`moe_reference`'s function, computing each token's k experts only: the N*k (token,
    expert) pairs sorted by expert, one pair of matmuls per expert on its contiguous rows."""
    return dispatch_experts(x, weights, experts, expert_ffns(w_gate_up, w_down, activation))


def expert_ffns(
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """The E experts' SwiGLUs (n_e, C) -> (n_e, C) of the stacked weights."""
    # unbind, not w[e]: the backward of E indexings would fill and add E full-size gradients.
    return [
        lambda xe, w1=w1, w2=w2: linear(activation(linear(xe, w1)), w2)
        for w1, w2 in zip(w_gate_up.unbind(0), w_down.unbind(0))
    ]


def dispatch_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    ffns: list[Callable[[torch.Tensor], torch.Tensor]],
) -> torch.Tensor:
    """The weighted sum of each token's k experts, ffns[e] the function of expert e (fp32's
    `expert_ffns`, or int8's: minillm.model.quantize), each run once on its tokens' rows."""
    N, k = experts.shape
    E = len(ffns)
    flat = experts.flatten()  # (N*k,) the expert of each (token, slot)
    order = flat.argsort(stable=True)  # the pairs grouped by expert
    token = order // k  # (N*k,) the token of each sorted pair
    # The group sizes go to the host (one sync per layer) to split the rows. Every expert runs,
    # an empty one on 0 rows: its weights are then in the graph with a zero gradient, which DDP
    # needs (a parameter without a gradient would stall its all-reduce).
    counts = torch.bincount(flat, minlength=E).tolist()
    rows = x.index_select(0, token).split(counts)  # E tensors (n_e, C)
    outs = [ffn(xe) for xe, ffn in zip(rows, ffns)]
    ys = torch.cat(outs) * weights.flatten()[order, None]  # (N*k, C), weighted in float32
    return torch.zeros_like(x).index_add_(0, token, ys.to(x.dtype))  # each token's k summed


@dataclass
class RouterStats:
    """One MoE layer's routing in the last forward: the load-balancing loss's ingredients."""

    prob_sum: torch.Tensor  # (E,) sum over tokens of the router probabilities (differentiable)
    counts: torch.Tensor  # (E,) float: how many tokens chose each expert (among their k)
    tokens: int  # N


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU of width S on every token, scaled per token by
    sigmoid(x . gate), gate (1, C) (HF's `shared_expert` and `shared_expert_gate`); ungated
    (`gated` False) DeepSeek-V3's `shared_experts`, its n_shared_experts fused into one width."""

    activation = staticmethod(swiglu)

    def __init__(self, d_model: int, hidden: int, gated: bool = True) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)
        self.gate = nn.Linear(d_model, 1, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.w_down(self.activation(self.w_gate_up(x)))  # (N, C)
        return y if self.gate is None else torch.sigmoid(self.gate(x)) * y


class MoE(nn.Module):
    """Router, softmax, top-k (renormalised or not), E SwiGLU experts stacked in 3-D weights, and
    optionally a gated shared expert (`SharedExpert`).

    The stacked weights are Hugging Face's `MixtralExperts` layout: w_gate_up[e] is
    [w1; w3] (gate; up) of expert e, w_down[e] its w2; the router is HF's
    `block_sparse_moe.gate`. `stats` holds the last forward's `RouterStats`, for the trainer's
    load-balancing loss and the expert-load scalars.
    """

    activation = staticmethod(swiglu)  # kernels_cpu swaps in a fused one

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, C = cfg.n_experts, cfg.d_model
        self.k, self.hidden = cfg.n_experts_per_token, cfg.moe_ffn_hidden
        self.normalize = cfg.moe_norm_topk
        self.router = nn.Linear(C, E, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(E, 2 * self.hidden, C))
        self.w_down = nn.Parameter(torch.empty(E, C, self.hidden))
        # model.moe_router sigmoid (DeepSeek-V3): the routing bias, HF's e_score_correction_bias.
        # A buffer: in the state dict and checkpoints, moved by train.moe_bias_update, never by
        # the optimizer. None (no state-dict entry) for the softmax router.
        sigmoid = cfg.moe_router == "sigmoid"
        self.register_buffer("router_bias", torch.zeros(E) if sigmoid else None)
        self.groups, self.scale = (cfg.moe_n_group, cfg.moe_topk_group), cfg.moe_routed_scale
        # None without model.moe_shared_ffn_hidden: no branch is taken on the decode step then.
        shared = cfg.moe_shared_ffn_hidden
        self.shared = SharedExpert(C, shared, gated=not sigmoid) if shared else None
        self.drop = nn.Dropout(cfg.dropout)
        self.stats: RouterStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, C), N = B*T
        if self.router_bias is None:
            probs, weights, experts = route(flat, self.router.weight, self.k, self.normalize)
        else:
            scores, weights, experts = route_sigmoid(
                flat, self.router.weight, self.router_bias, self.k, self.groups, self.normalize,
                self.scale,
            )  # fmt: skip
            # The load-balancing loss reads each token's scores normalised to sum to 1
            # (DeepSeek-V3's balance loss does; it takes them per sequence, this per batch).
            probs = scores / scores.sum(dim=-1, keepdim=True)
        counts = torch.bincount(experts.flatten(), minlength=probs.shape[1]).float()
        self.stats = RouterStats(probs.sum(dim=0), counts, flat.shape[0])
        y = dispatch_experts(flat, weights, experts, self.expert_ffns())
        if self.shared is not None:
            y = y + self.shared(flat)
        return self.drop(y.view(x.shape))

    def expert_ffns(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """The E experts' functions (minillm.model.quantize's int8 MoE has its own)."""
        return expert_ffns(self.w_gate_up, self.w_down, self.activation)


def router_stats(model: nn.Module) -> list[RouterStats]:
    """The `RouterStats` of each MoE layer of `model` (a Transformer) from its last forward."""
    return [m.stats for m in model.modules() if isinstance(m, MoE) and m.stats is not None]


def biased_moes(model: nn.Module) -> list[MoE]:
    """The MoE layers of `model` with a routing bias (model.moe_router sigmoid), in order."""
    return [m for m in model.modules() if isinstance(m, MoE) and m.router_bias is not None]


@torch.no_grad()
def update_router_bias(model: nn.Module, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, as torchtitan writes it: load (L, E) the
    tokens each expert of each biased layer received over an optimizer step (all micro-batches
    and ranks); each bias moves by `rate` towards balance, up for an expert under its layer's
    mean load, down for one over it, the change centred so a layer's biases keep their sum."""
    moes = biased_moes(model)
    if len(moes) != load.shape[0]:
        raise ValueError(f"a load of {load.shape[0]} layers for {len(moes)} biased MoE layers")
    delta = rate * torch.sign(load.mean(dim=1, keepdim=True) - load)  # (L, E)
    delta = delta - delta.mean(dim=1, keepdim=True)
    for moe, d in zip(moes, delta):
        moe.router_bias.add_(d.to(moe.router_bias.dtype))


def router_bias_scalars(model: nn.Module) -> dict[str, float]:
    """xray/moe/bias_spread: the largest max - min of a layer's routing biases ({} without)."""
    moes = biased_moes(model)
    if not moes:
        return {}
    spread = max(float(m.router_bias.max() - m.router_bias.min()) for m in moes)
    return {"xray/moe/bias_spread": spread}


def load_balancing_loss(stats: list[RouterStats], n_experts: int) -> torch.Tensor:
    """Switch Transformer's load balancing, per layer and averaged over the layers:
    mean_l E * sum_e f_le P_le, with f_le the fraction of layer l's tokens that have e among their
    k (sums to k) and P_le the mean router probability of e there (sums to 1). Its minimum, where
    every expert of every layer gets as many tokens and as much probability, is k (1 for Switch's
    top-1). For one layer it is transformers' `load_balancing_loss_func`; for several, that
    function pools the layers' tokens first, so layers unbalanced in opposite ways pass for
    balanced (transformers issues #28255, #31464; measured on the demo in docs/benchmarks.md)."""
    per_layer = [(s.counts / s.tokens) @ (s.prob_sum / s.tokens) for s in stats]
    return n_experts * torch.stack(per_layer).mean()
