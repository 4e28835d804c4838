"""CUDA graphs of decode steps: captured once per batch size at start, replayed with new inputs.

A decode step launches hundreds of small kernels; replaying a captured graph launches them as one. The
graphs read their inputs from static tensors (ids, positions, slots, lengths, block tables) that each
replay fills, padded to the captured size (padding rows write to slot -1 and attend to one position).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from cachegw.backend.executor.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from cachegw.backend.executor.model_runner import StepInputs

log = logging.getLogger("cachegw.backend")


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model, self.max_model_len = model, max_model_len
        limit = max_num_seqs
        self.sizes = sorted({s for s in [1, 2, 4, 8, *range(16, 513, 16)] if s <= limit} | {limit})
        top = max(self.sizes)
        self.static = {
            "ids": torch.zeros(top, dtype=torch.long, device=device),
            "pos": torch.zeros(top, dtype=torch.long, device=device),
            "slots": torch.full((top,), -1, dtype=torch.long, device=device),
            "starts": torch.arange(top + 1, dtype=torch.int32, device=device),
            "lens": torch.ones(top, dtype=torch.int32, device=device),
            "tables": torch.zeros(top, max_blocks_per_seq, dtype=torch.int32, device=device),
            "out": torch.zeros(top, hidden_size, dtype=dtype, device=device),
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):
                meta = self._meta(size)
                st = self.static
                self.model(st["ids"][:size], st["pos"][:size], meta)  # warm up kernels before capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    st["out"][:size] = self.model(st["ids"][:size], st["pos"][:size], meta)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize(device)
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def __len__(self) -> int:
        return len(self.graphs)

    def size_for(self, n: int) -> int | None:
        """The smallest captured batch size that holds ``n`` sequences (None: none does)."""
        return next((size for size in self.sizes if size >= n), None)

    def _meta(self, size: int) -> AttentionMetadata:
        st = self.static
        return AttentionMetadata(
            slot_mapping=st["slots"][:size],
            query_start_loc=st["starts"][: size + 1],
            seq_lens=st["lens"][:size],
            block_tables=st["tables"][:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            num_decodes=size,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,
        )

    def replay(self, size: int, inputs: StepInputs) -> torch.Tensor:
        """The hidden states of the sampled rows of a decode step, through the graph of ``size``."""
        st, n, meta = self.static, inputs.input_ids.shape[0], inputs.meta
        st["ids"][:n] = inputs.input_ids
        st["pos"][:n] = inputs.positions
        st["slots"][:size].fill_(-1)
        st["slots"][:n] = meta.slot_mapping
        st["lens"][:size].fill_(1)
        st["lens"][:n] = meta.seq_lens
        st["tables"][:size].zero_()
        st["tables"][:n, : meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[size].replay()
        return st["out"][:n][inputs.sample_indices]
