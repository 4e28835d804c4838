"""DeepSeek-V2/V3's mixture of experts: a router picks ``top_k`` routed experts per token, whose
SwiGLU outputs are summed with the router's weights, plus always-on shared experts.

Experts run as a loop over the experts some token of the step chose, each on its tokens alone (a
gather, two matmuls, a weighted scatter-add): no grouped GEMM, so a large MoE is slow here, but the
result is the model's. Routing follows transformers' models of each version:

- V2: softmax scores; ``greedy`` top-k, or ``group_limited_greedy`` (top-k within the ``topk_group``
  groups of experts whose best score is highest); weights times ``routed_scaling_factor``;
- V3: sigmoid scores; experts chosen by score plus ``e_score_correction_bias`` within the
  ``topk_group`` groups of highest top-2 sum, weighted by the score alone, normalized when
  ``norm_topk_prob``, times ``routed_scaling_factor``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from cachegw.backend.executor.models.llama import LlamaMLP, ModelSpec


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared: int
    scaling: float  # routed_scaling_factor
    version: int  # 2: softmax routing; 3: sigmoid with a correction bias
    topk_method: str  # V2: greedy | group_limited_greedy
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool

    @classmethod
    def from_hf_config(cls, config, version: int) -> MoESpec | None:
        """None for a model whose every layer is dense (no routed experts, or none past the dense ones)."""
        experts = getattr(config, "n_routed_experts", None) or 0
        if not experts or config.first_k_dense_replace >= config.num_hidden_layers:
            return None
        method = getattr(config, "topk_method", None) or "greedy"
        if version == 2 and method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"DeepSeek-V2 topk_method={method!r} is not supported (greedy, group_limited_greedy)"
            )
        return cls(
            num_experts=experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            num_shared=getattr(config, "n_shared_experts", None) or 0,
            scaling=float(getattr(config, "routed_scaling_factor", 1.0)),
            version=version,
            topk_method=method,
            num_groups=getattr(config, "n_group", None) or 1,
            topk_groups=getattr(config, "topk_group", None) or 1,
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
        )


class Router(nn.Module):
    """Scores in float32 (the checkpoints keep the gate in float32); returns (weights, experts) [T, k]."""

    def __init__(self, hidden: int, moe: MoESpec) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden, dtype=torch.float32))
        if moe.version == 3:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32))

    def _group_mask(self, scores: torch.Tensor, per_group: torch.Tensor) -> torch.Tensor:
        """Scores outside the ``topk_groups`` best groups (by ``per_group`` [T, groups]) masked out."""
        m = self.moe
        chosen = per_group.topk(m.topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, chosen, True)
        keep = keep.repeat_interleave(m.num_experts // m.num_groups, dim=1)
        return scores.masked_fill(~keep, 0.0 if m.version == 2 else float("-inf"))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.moe
        logits = F.linear(x.float(), self.weight.float())
        if m.version == 2:
            scores = logits.softmax(dim=-1)
            if m.topk_method == "group_limited_greedy":
                scores = self._group_mask(
                    scores, scores.view(-1, m.num_groups, m.num_experts // m.num_groups).amax(-1)
                )
            weights, experts = scores.topk(m.top_k, dim=-1, sorted=False)
        else:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            groups = choice.view(-1, m.num_groups, m.num_experts // m.num_groups).topk(2, dim=-1)[0].sum(-1)
            experts = self._group_mask(choice, groups).topk(m.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, experts)
            if m.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.scaling, experts


class DeepseekMoE(nn.Module):
    def __init__(self, spec: ModelSpec, moe: MoESpec) -> None:
        super().__init__()
        self.gate = Router(spec.hidden_size, moe)
        expert = replace(spec, intermediate_size=moe.intermediate_size)
        self.experts = nn.ModuleList(LlamaMLP(expert) for _ in range(moe.num_experts))
        shared = replace(spec, intermediate_size=moe.intermediate_size * moe.num_shared)
        self.shared_experts = LlamaMLP(shared) if moe.num_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():  # ascending, as transformers adds them
            tokens, slot = torch.where(experts == e)
            y = self.experts[e](x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out if self.shared_experts is None else out + self.shared_experts(x)
