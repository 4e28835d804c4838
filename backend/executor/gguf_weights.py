"""The quantized linear weights of a GGUF file, read as their integer blocks (not dequantized).

Q4_0, Q4_1 and Q8_0 store blocks of 32 weights along a row with their own scale (and, for Q4_1,
minimum), which is what weight-only int4/int8 kernels want: keeping the file's integers and scales
avoids a second rounding. Other types come back dequantized (``gguf.quants.dequantize``) for the
caller to quantize again or keep in float. Tensor names are mapped to Hugging Face's, and Llama's
Q/K rows are put back in Hugging Face's rotary order, as transformers' GGUF reader does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCK = 32
EXACT_TYPES = ("Q4_0", "Q4_1", "Q8_0")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class BlockWeights:
    """One [out, in] weight as blocks of 32 along ``in``: w = scale * q + offset (per block).

    ``q`` is [out, in] uint8 in 0..15 for Q4_0/Q4_1 (Q4_0's offset is -8 * scale) and int8 for
    Q8_0 (offset 0); ``scale`` and ``offset`` are float32 [out, in / 32].
    """

    kind: str
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.view(n, k // BLOCK, BLOCK).float() * self.scale[..., None] + self.offset[..., None]
        return w.view(n, k)

    def rows(self, order: torch.Tensor) -> BlockWeights:
        return BlockWeights(self.kind, self.q[order], self.scale[order], self.offset[order])


@dataclass(frozen=True)
class GgufLinear:
    """A linear weight as the file holds it: its blocks when the type is one of EXACT_TYPES."""

    name: str  # Hugging Face name, e.g. model.layers.0.self_attn.q_proj.weight
    kind: str  # the GGML type name (Q4_1, Q6_K, F16, ...)
    blocks: BlockWeights | None
    dense: torch.Tensor | None  # float32 [out, in] for the other types

    def to_float(self) -> torch.Tensor:
        return self.blocks.dequantize() if self.blocks is not None else self.dense  # type: ignore[return-value]


def decode_blocks(kind: str, raw: np.ndarray) -> BlockWeights:
    """Split the raw bytes [rows, bytes per row] of a Q4_0/Q4_1/Q8_0 tensor into integers and scales."""
    rows = raw.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, size)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8)
        offset = np.zeros_like(scale)
    else:
        start = 2 if kind == "Q4_0" else 4
        packed = blocks[..., start:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # low nibbles are 0..15
        if kind == "Q4_0":
            offset = -8.0 * scale
        else:
            offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return BlockWeights(
        kind,
        torch.from_numpy(np.ascontiguousarray(q).reshape(rows, -1)),
        torch.from_numpy(scale),
        torch.from_numpy(np.ascontiguousarray(offset)),
    )


def _rotary_row_order(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp interleaves each head's rotary halves; this order restores Hugging Face's."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def read_linears(path: Path, num_heads: int, num_kv_heads: int) -> Iterator[GgufLinear]:
    """Every per-layer projection weight of the file (biases, norms and embeddings are not here)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else ""
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES or parts[3] != "weight":
            continue
        name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
        kind = t.tensor_type.name
        if kind in EXACT_TYPES:
            blocks: BlockWeights | None = decode_blocks(kind, t.data)
            dense = None
        else:
            blocks = None
            dense = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).copy())
        if arch == "llama" and parts[2] in ("attn_q", "attn_k"):
            rows = blocks.q.shape[0] if blocks is not None else dense.shape[0]  # type: ignore[union-attr]
            order = _rotary_row_order(rows, num_heads if parts[2] == "attn_q" else num_kv_heads)
            if blocks is not None:
                blocks = blocks.rows(order)
            else:
                dense = dense[order]  # type: ignore[index]
        yield GgufLinear(name, kind, blocks, dense)
