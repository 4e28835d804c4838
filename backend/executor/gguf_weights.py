"""The quantized linear weights of a GGUF file, read as their integer blocks (not dequantized).

Q4_0, Q4_1 and Q8_0 store blocks of 32 weights along a row with their own scale (and, for Q4_1,
minimum), which is what weight-only int4/int8 kernels want: keeping the file's integers and scales
avoids a second rounding. Other types come back dequantized (``gguf.quants.dequantize``) for the
caller to quantize again or keep in float. Tensor names are mapped to Hugging Face's, and Llama's
Q/K rows are put back in Hugging Face's rotary order, as transformers' GGUF reader does. The file
stays memory-mapped and each tensor is decoded when asked for (``GgufFile``), so a loader never
holds more than the layer it is building beside the finished ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from cachegw.backend.executor.gguf_table import TableTensor, read_table, release_pages

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
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma's files name its four norms a layer otherwise (its ``ffn_norm`` is the one before the MLP),
# and store each norm's weight as 1 + w (llama.cpp's Gemma norm multiplies by the weight alone).
_GEMMA_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA = ("gemma2", "gemma3")
# Phi-3's files keep its fused projections (llama.cpp's ``ffn_up`` holds gate then up); ``GgufFile``
# shows their rows as the parts Llama's loader takes
_PHI3_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
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


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.
    q_proj.weight``), or None for one the model does not use."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    names = _GEMMA_NAMES if arch in _GEMMA else _PHI3_NAMES if arch == "phi3" else _LAYER_NAMES
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in names:
        return None
    return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"


def split_fused(tensors: dict[str, TableTensor], num_heads: int, num_kv_heads: int) -> dict[str, TableTensor]:
    """Fused ``qkv_proj``/``gate_up_proj`` tensors as their parts: views of the same mapped rows
    (a block type's rows are independent), so they load, as blocks or floats, like Llama's."""
    out: dict[str, TableTensor] = {}
    for name, t in tensors.items():
        proj = name.split(".")[-2]
        rows = int(t.data.shape[0])
        if proj == "qkv_proj":
            head_dim = rows // (num_heads + 2 * num_kv_heads)
            sizes = {"q_proj": num_heads * head_dim, "k_proj": num_kv_heads * head_dim}
            sizes["v_proj"] = sizes["k_proj"]
        elif proj == "gate_up_proj":
            sizes = {"gate_proj": rows // 2, "up_proj": rows // 2}
        else:
            out[name] = t
            continue
        start = 0
        for part, n in sizes.items():
            out[name.replace(f".{proj}.", f".{part}.")] = replace(t, data=t.data[start : start + n])
            start += n
    return out


class GgufFile:
    """A GGUF's tensors by Hugging Face name, read from the memory-mapped file only when asked for,
    so a loader holds one tensor's worth of decoded data at a time; ``close`` unmaps the file."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int) -> None:
        arch, tensors = read_table(path)
        self.architecture = arch  # general.architecture: "llama", "qwen3", ...
        self._tensors = {n: t for t in tensors if (n := hf_name(t.name, arch)) is not None}
        if arch == "phi3":
            self._tensors = split_fused(self._tensors, num_heads, num_kv_heads)
        self._norm_offset = -1.0 if arch in _GEMMA else 0.0
        # llama.cpp's converter permuted Llama's Q/K rows; other architectures keep Hugging Face's
        self._rotary_heads = {"q_proj": num_heads, "k_proj": num_kv_heads} if arch == "llama" else {}

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def kind(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def _order(self, name: str, rows: int) -> torch.Tensor | None:
        proj = name.split(".")[-2]
        heads = self._rotary_heads.get(proj)
        return None if heads is None else _rotary_row_order(rows, heads)

    def blocks(self, name: str) -> BlockWeights:
        """A Q4_0/Q4_1/Q8_0 tensor's integer blocks, in Hugging Face's row order."""
        t = self._tensors[name]
        blocks = decode_blocks(t.tensor_type.name, t.data)  # copies: the file's pages may go
        release_pages(t.data)
        order = self._order(name, blocks.q.shape[0])
        return blocks if order is None else blocks.rows(order)

    def rows(self, name: str) -> int:
        return int(self._tensors[name].data.shape[0])

    def block_rows(self, name: str, chunk: int = 4096) -> Iterator[BlockWeights]:
        """A Q4_0/Q4_1/Q8_0 tensor's blocks ``chunk`` rows at a time (a tensor whose rows the file
        keeps in Hugging Face's order: not Llama's Q/K projections)."""
        t = self._tensors[name]
        if self._order(name, 1) is not None:
            raise ValueError(f"{name}: its rows are reordered, read it with blocks()")
        for start in range(0, t.data.shape[0], chunk):
            yield decode_blocks(t.tensor_type.name, t.data[start : start + chunk])
            release_pages(t.data[start : start + chunk])

    def dense(self, name: str, dtype: torch.dtype = torch.float32, chunk: int = 512) -> torch.Tensor:
        """Any tensor dequantized into ``dtype``; block types ``chunk`` rows at a time, so no float32
        copy of a whole embedding exists beside the result (and the small temporaries are reused
        rather than left behind in the heap, as a few big ones were)."""
        from gguf.quants import dequantize

        t = self._tensors[name]
        kind = t.tensor_type.name
        if kind in EXACT_TYPES:
            rows = t.data.shape[0]
            out = torch.empty(
                rows, t.data.shape[1] // {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind] * BLOCK, dtype=dtype
            )
            for start in range(0, rows, chunk):
                out[start : start + chunk] = decode_blocks(kind, t.data[start : start + chunk]).dequantize()
        else:
            out = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).copy())
            if self._norm_offset and name.endswith("norm.weight"):
                out += self._norm_offset  # in float32, before any rounding to ``dtype``
            out = out.to(dtype)
        release_pages(t.data)
        order = self._order(name, out.shape[0])
        return out if order is None else out[order]

    def linear(self, name: str) -> GgufLinear:
        """A projection weight: its blocks where the type is one of EXACT_TYPES, else float32."""
        kind = self.kind(name)
        if kind in EXACT_TYPES:
            return GgufLinear(name, kind, self.blocks(name), None)
        return GgufLinear(name, kind, None, self.dense(name))

    def close(self) -> None:
        """Drop the tensors' views of the memory map, so the file's pages leave the process."""
        self._tensors.clear()
