"""Paged attention: write new K/V into the block cache, then attend over it.

One step of the engine carries a flat batch of tokens from several sequences. Sequences are
ordered decodes first (one query token each), then prefill chunks. For sequence ``s`` the
query tokens ``q[query_start_loc[s]:query_start_loc[s+1]]`` sit at the last positions of its
context of ``seq_lens[s]`` tokens, and each attends causally to every cached key at or before
its own position, or with a sliding window ``W`` to the last ``W`` of them (keys at positions
``p`` with ``q_pos - W < p <= q_pos``, as transformers masks Mistral and Qwen2). Blocks wholly
before a sequence's window are never read, so the engine may free them (their table entries then
point at block 0). The same contract holds for the torch path below (every machine) and the
Triton kernels in ``triton_attention.py`` (CUDA).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from cachegw.backend.executor.layers import kv_quant
from cachegw.backend.executor.layers.softcap import attend


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the KV cache and which cached keys each one sees."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [S + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [S] int32: context length of each sequence after this step
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    decode_groups: list[tuple[int, int]] | None = None  # torch path: set on first use in a step
    key_mass: torch.Tensor | None = None  # [S, max_seq_len] float32: H2O wants each key's attention

    def groups(self) -> list[tuple[int, int]]:
        """The decodes in groups of similar context length (``decode_groups``), computed once a step."""
        if self.decode_groups is None:
            self.decode_groups = decode_groups(self.seq_lens_cpu[: self.num_decodes])
        return self.decode_groups

    @classmethod
    def one_prefill(cls, n: int, block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """One sequence of ``n`` new tokens in blocks 0, 1, ... (start-up warm-up, offline scoring)."""
        blocks = -(-n // block_size)
        return cls(
            slot_mapping=torch.arange(n, device=device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
            max_query_len=n,
            max_seq_len=n,
            num_decodes=0,
            query_lens_cpu=[n],
            seq_lens_cpu=[n],
        )


@dataclass
class DecodeMetadata:
    """A step of decodes only (one query token per sequence), held as tensors alone.

    What the compiled decode step (``backend/executor/compiled_decode.py``) is traced with: no Python ints
    or lists, so one compiled graph serves every batch size and context length.
    """

    slot_mapping: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, blocks]: every block of the longest context, padded with 0
    seq_lens: torch.Tensor  # [B] context length after this step


# What one step of the model runs with: the eager engine's metadata, or the compiled decode's.
StepMetadata = AttentionMetadata | DecodeMetadata


def store_kv_torch(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Scatter K/V of shape [T, KVH, D] into caches of shape [num_blocks, block_size, KVH, D]
    (an int8 or fp8 cache: quantized on the way, ``kv_quant.py``)."""
    if kv_quant.quantized(k_cache, key.dtype):
        storage = k_cache.dtype
        key, value = kv_quant.encode(torch.stack((key, value)), storage)
        k_cache, v_cache = kv_quant.indexable(k_cache), kv_quant.indexable(v_cache)
    kvh, d = key.shape[1], key.shape[2]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, key)
    v_cache.view(-1, kvh, d).index_copy_(0, slots, value)


# Decodes are padded to the longest context of their group; a new group starts when a context is
# shorter than this fraction of the group's longest, which bounds the padding read to about 25%.
_GROUP_FILL = 0.75
_scratch = threading.local()


def _scratch_rows(slot: str, n: int, like: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
    """``n`` blocks shaped as ``like``'s (last dim ``width``) from a reused per-thread buffer."""
    shape = tuple(like.shape[1:-1]) + (width,)
    key = (slot, dtype, like.device, shape, torch.is_inference_mode_enabled())
    buf = getattr(_scratch, "bufs", {}).get(key)
    if buf is None or buf.shape[0] < n:
        buf = torch.empty((max(n, 64),) + shape, dtype=dtype, device=like.device)
        _scratch.__dict__.setdefault("bufs", {})[key] = buf
    return buf[:n]


def _gather_blocks(
    cache: torch.Tensor, tables: torch.Tensor, slot: str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """cache[tables] into a reused per-thread buffer: a fresh multi-MB tensor each layer costs page
    faults. An int8/fp8 cache is read back into ``dtype`` (the compute dtype) on the way."""
    n = tables.numel()
    if dtype is not None and kv_quant.quantized(cache, dtype):
        raw_cache = kv_quant.indexable(cache)
        raw = _scratch_rows(slot + ":raw", n, raw_cache, raw_cache.dtype, raw_cache.shape[-1])
        torch.index_select(raw_cache, 0, tables.reshape(-1), out=raw)
        out = _scratch_rows(slot, n, cache, dtype, kv_quant.head_dim(cache))
        kv_quant.decode(raw, cache.dtype, out)
        return out.view(tables.shape + out.shape[1:])
    out = _scratch_rows(slot, n, cache, cache.dtype, cache.shape[-1])
    torch.index_select(cache, 0, tables.reshape(-1), out=out)
    return out.view(tables.shape + cache.shape[1:])


def read_blocks(cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[table] in the compute ``dtype`` (a prefill chunk's cached prefix, the sinks' keys)."""
    if not kv_quant.quantized(cache, dtype):
        return cache[table]
    raw = kv_quant.indexable(cache)[table]
    out = torch.empty(raw.shape[:-1] + (kv_quant.head_dim(cache),), dtype=dtype, device=cache.device)
    return kv_quant.decode(raw, cache.dtype, out)


def decode_groups(seq_lens: list[int]) -> list[tuple[int, int]]:
    """Split decodes into [lo, hi) groups of similar context length (any order is correct; the
    scheduler sorts decodes by length so that the groups are few and dense)."""
    groups: list[tuple[int, int]] = []
    lo, low, high = 0, 0, 0
    for i, n in enumerate(seq_lens):
        if i > lo and min(low, n) < _GROUP_FILL * max(high, n):
            groups.append((lo, i))
            lo = i
        low, high = (n, n) if i == lo else (min(low, n), max(high, n))
    if seq_lens:
        groups.append((lo, len(seq_lens)))
    return groups


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    new_k: torch.Tensor | None = None,
    new_v: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention for every query token of the step; q is [T, H, D], returns [T, H, D].

    Decodes are done in batched calls over their gathered blocks, one call per group of similar
    context length; each prefill chunk is done on its own. A prefill with nothing cached before
    it uses ``new_k``/``new_v`` directly and skips the gather. With a ``window``, only the blocks
    from the earliest window start on are gathered.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    nd = meta.num_decodes
    for lo, hi in meta.groups():
        n = hi - lo
        max_blocks = (max(meta.seq_lens_cpu[lo:hi]) + block_size - 1) // block_size
        first = _first_block(min(meta.seq_lens_cpu[lo:hi]) - 1, window, block_size)
        tables = meta.block_tables[lo:hi, first:max_blocks]
        length = (max_blocks - first) * block_size
        keys = (
            _gather_blocks(k_cache, tables, "k", q.dtype).view(n, length, kv_heads, head_dim).transpose(1, 2)
        )
        values = (
            _gather_blocks(v_cache, tables, "v", q.dtype).view(n, length, kv_heads, head_dim).transpose(1, 2)
        )
        positions = torch.arange(first * block_size, max_blocks * block_size, device=q.device)
        out[lo:hi] = _attend_decodes(
            q[lo:hi], keys, values, positions, meta.seq_lens[lo:hi], scale, window, softcap
        )
    starts = meta.query_start_loc.tolist() if len(meta.query_lens_cpu) > nd else []
    for s in range(nd, len(meta.query_lens_cpu)):
        q_len, ctx = meta.query_lens_cpu[s], meta.seq_lens_cpu[s]
        lo = starts[s]
        queries = q[lo : lo + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask: torch.Tensor | None = None
        if ctx == q_len and new_k is not None and new_v is not None:
            keys = new_k[lo : lo + q_len].transpose(0, 1).unsqueeze(0)
            values = new_v[lo : lo + q_len].transpose(0, 1).unsqueeze(0)
            k_pos = q_pos
        else:
            nblocks = (ctx + block_size - 1) // block_size
            first = _first_block(ctx - q_len, window, block_size)
            table = meta.block_tables[s, first:nblocks]
            span = ctx - first * block_size
            keys = (
                read_blocks(k_cache, table, q.dtype)
                .view(-1, kv_heads, head_dim)[:span]
                .transpose(0, 1)
                .unsqueeze(0)
            )
            values = (
                read_blocks(v_cache, table, q.dtype)
                .view(-1, kv_heads, head_dim)[:span]
                .transpose(0, 1)
                .unsqueeze(0)
            )
            k_pos = torch.arange(first * block_size, ctx, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
        if window is not None and ctx > window:
            near = k_pos[None, :] > q_pos[:, None] - window
            mask = near & (k_pos[None, :] <= q_pos[:, None]) if mask is None else mask & near
        res = attend(queries, keys, values, mask, scale, softcap, is_causal=mask is None)
        out[lo : lo + q_len] = res[0].transpose(0, 1)
    return out


def _visible(positions: torch.Tensor, seq_lens: torch.Tensor, window: int | None) -> torch.Tensor:
    """[n, L]: which keys at ``positions`` each sequence's query sees (before its context end, and
    within its window)."""
    ends = seq_lens[:, None]
    seen = positions[None, :] < ends
    if window is not None:
        seen &= positions[None, :] >= ends - window
    return seen


def _attend_decodes(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence over its gathered keys [n, KVH, L, D] at ``positions`` [L];
    returns [n, H, D]."""
    n, num_heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    # The query heads of one KV group act as that group's query rows: no K/V repeat needed.
    queries = q.view(n, kv_heads, num_heads // kv_heads, head_dim)
    mask = _visible(positions, seq_lens, window).view(n, 1, 1, positions.shape[0])
    return attend(queries, keys, values, mask, scale, softcap).reshape(n, num_heads, head_dim)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decodes as one padded group over every block of their tables, in tensor ops alone.

    Attention is spelled out (two batched matmuls around scale, mask and softmax) rather than SDPA:
    in the compiled graph Inductor fuses the middle into one loop, while SDPA stays an opaque call
    that cost 3-5x as much per layer for a single query row (profiled at batch 1)."""
    n, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    length = meta.block_tables.shape[1] * block_size
    flat = meta.block_tables.reshape(-1)
    keys = read_blocks(k_cache, flat, q.dtype).view(n, length, kv_heads, head_dim).transpose(1, 2)
    values = read_blocks(v_cache, flat, q.dtype).view(n, length, kv_heads, head_dim).transpose(1, 2)
    seen = _visible(torch.arange(length, device=q.device), meta.seq_lens, window)
    queries = q.view(n, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~seen.view(n, 1, 1, length), float("-inf"))
    return torch.matmul(scores.softmax(-1), values).reshape(n, num_heads, head_dim)


def _first_block(q_pos: int, window: int | None, block_size: int) -> int:
    """The first block holding a key the query at ``q_pos`` (or any later one) can see."""
    return 0 if window is None else max(0, q_pos - window + 1) // block_size


class PagedAttention(torch.nn.Module):
    """Stores this step's K/V in the layer's cache, then attends; the runner assigns the caches.

    CUDA caches use the Triton kernels; every other device uses the torch path above.
    ``use_triton`` forces the choice (tests run the Triton path on CPU in Triton's interpreter).
    """

    use_triton: bool | None = None

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = (
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        )
        self.sliding_window = sliding_window
        self.softcap: float | None = None  # Gemma 2's score cap: torch path only (layers/softcap.py)
        self.sinks = 0  # StreamingLLM: the first ``sinks`` positions stay visible (torch path only)
        # the op namespace of cachegw's CPU kernel for the compiled decode step's attention (None:
        # torch's); the runner sets it where ``[engine] cpu_kernels``, the CPU, the head size and
        # float32 or int8 caches allow
        self.native_decode: str | None = None
        # every query row on cachegw's decode kernel (the op namespace), where the fused decode step runs:
        # a row's result then follows neither the step's row count nor what the prefix cache held
        self.row_ops: str | None = None
        self.row_prefill = True  # False: prefill chunks keep torch's attention (builds without a fast one)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    @property
    def span(self) -> int:
        """Sinks plus window: the most positions one query sees in streaming mode."""
        return self.sinks + (self.sliding_window or 0)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: StepMetadata,
        q_sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(meta, DecodeMetadata):  # the compiled decode step: torch path, no sinks
            store_kv_torch(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            window = self.sliding_window
            if self.native_decode:
                return getattr(torch.ops, self.native_decode).paged_decode_attention(
                    q.contiguous(),
                    self.k_cache,
                    self.v_cache,
                    meta.block_tables,
                    meta.seq_lens,
                    self.scale,
                    window or 0,
                )
            return decode_attention_torch(
                q, self.k_cache, self.v_cache, meta, self.scale, window, self.softcap
            )
        if self.row_ops is not None and (self.row_prefill or q.shape[0] == meta.seq_lens.shape[0]):
            store_kv_torch(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            return getattr(torch.ops, self.row_ops).paged_attention(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                self.scale, self.sliding_window or 0,
            )  # fmt: skip
        if meta.key_mass is not None:  # H2O: weights spelled out, each key's share summed
            from cachegw.backend.executor.layers.scored_attention import scored_attention

            store_kv_torch(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            return scored_attention(q, self.k_cache, self.v_cache, meta, self.scale, meta.key_mass)
        if q_sink is not None and self.sliding_window is not None:
            from cachegw.backend.executor.layers.sinks import sink_attention

            store_kv_torch(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            return sink_attention(
                q, q_sink, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window, self.sinks
            )
        if self.k_cache.is_cuda if self.use_triton is None else self.use_triton:
            from cachegw.backend.executor.layers import triton_attention

            triton_attention.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            return triton_attention.paged_attention_triton(
                q, self.k_cache, self.v_cache, meta, self.scale, window=self.sliding_window
            )
        store_kv_torch(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return paged_attention_torch(
            q, self.k_cache, self.v_cache, meta, self.scale, k, v, self.sliding_window, self.softcap
        )
