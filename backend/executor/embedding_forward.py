"""Embeddings from the generation model: one forward pass over the inputs, outside the paged KV cache.

An embedding is the model's final hidden states (after the final norm) averaged over the input's
tokens and scaled to unit length. The forward is the model's own (same weights, same kernels), run on
a view of the model whose attention layers write their keys and values into a scratch cache of the
batch's own size, never into the engine's KV blocks, which running requests hold. The view shares
every weight; only the attention modules are copies, so setting their caches touches nothing the
engine (or the compiled decode step, which may be tracing in its own thread) reads.

Callers run ``embed`` in the engine's loop thread (``AsyncEngine.run_between_steps``): the forward
never overlaps a step, so the device's memory holds one or the other's activations, not both.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from cachegw.backend.core.block_manager import cdiv
from cachegw.backend.executor.layers.attention import AttentionMetadata, PagedAttention
from cachegw.backend.executor.model_runner import ModelRunner
from cachegw.backend.executor.models.llama import LlamaForCausalLM


def _own_attention(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` in which each PagedAttention, and each module on the way to one, is
    a copy: their ``k_cache``/``v_cache`` can be set without touching the original's. Every other
    module (projections, norms, quantized layers) is the original itself, weights and all."""
    if not any(isinstance(m, PagedAttention) for m in module.modules()):
        return module
    twin = copy.copy(module)
    twin._modules = {name: _own_attention(c) for name, c in module._modules.items() if c is not None}
    return twin


def pack_order(lengths: list[int]) -> list[int]:
    """The inputs' order in a batch: one-token inputs first, as the attention expects of decodes."""
    return sorted(range(len(lengths)), key=lambda i: lengths[i] > 1)


def batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of input indices of at most ``budget`` tokens each (an input longer than the
    budget is a group of its own): one forward pass each, one engine-thread call each."""
    groups: list[list[int]] = []
    used = budget
    for i, n in enumerate(lengths):
        if used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


class MeanPooledEmbedder:
    """Mean-pooled, L2-normalized final hidden states of the engine's model."""

    def __init__(self, runner: ModelRunner) -> None:
        self.model = _own_attention(runner.model)
        assert isinstance(self.model, LlamaForCausalLM)
        self.attention = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.block_size = runner.block_size
        self.device = runner.device
        self.kv_format = runner.kv_format
        self.num_kv_heads = runner.spec.num_kv_heads
        self.hidden_size = runner.spec.hidden_size

    def _scratch(self, blocks: int) -> torch.Tensor:
        """One cache every layer shares: a layer reads only what it wrote itself just before."""
        shape = (blocks, self.block_size, self.num_kv_heads, self.kv_format.row_width)
        return torch.zeros(shape, dtype=self.kv_format.storage_dtype, device=self.device)

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """float32 [len(inputs), hidden] on the CPU, each row of unit length, in the inputs' order."""
        order = pack_order([len(ids) for ids in inputs])
        seqs = [inputs[i] for i in order]
        lens = [len(ids) for ids in seqs]
        bs, dev = self.block_size, self.device
        first_block = [0]
        for n in lens:
            first_block.append(first_block[-1] + cdiv(n, bs))
        width = max(cdiv(n, bs) for n in lens)
        tables = [list(range(first_block[i], first_block[i + 1])) for i in range(len(seqs))]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(
                [first_block[i] * bs + p for i, n in enumerate(lens) for p in range(n)], device=dev
            ),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev
            ),
            max_query_len=max(lens),
            max_seq_len=max(lens),
            num_decodes=sum(1 for n in lens if n == 1),
            query_lens_cpu=lens,
            seq_lens_cpu=lens,
        )
        k_cache, v_cache = self._scratch(first_block[-1]), self._scratch(first_block[-1])
        for attn in self.attention:
            attn.k_cache, attn.v_cache = k_cache, v_cache
        try:
            ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=dev)
            positions = torch.tensor([p for n in lens for p in range(n)], dtype=torch.long, device=dev)
            hidden = self.model(ids, positions, meta).float()
        finally:
            for attn in self.attention:  # the scratch goes with this call
                attn.k_cache = attn.v_cache = torch.empty(0)
        owner = torch.repeat_interleave(torch.arange(len(seqs), device=dev), torch.tensor(lens, device=dev))
        sums = torch.zeros(len(seqs), self.hidden_size, device=dev).index_add_(0, owner, hidden)
        pooled = sums / torch.tensor(lens, dtype=torch.float32, device=dev)[:, None]
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
        out = torch.empty_like(pooled)
        out[torch.tensor(order, device=dev)] = pooled
        return out.cpu()
