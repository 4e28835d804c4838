"""Paged attention: the Triton kernels and the torch path against a dense float64 reference.

Without CUDA the kernels run in Triton's CPU interpreter, which ``triton.jit`` picks when a kernel
(including triton's own library functions) is defined. So the flag is set before the first triton
import; if another test module imported triton earlier, the kernel tests rerun this file in a
fresh process instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from cachegw.backend.executor.layers import kv_quant  # noqa: E402
from cachegw.backend.executor.layers import triton_attention as ta  # noqa: E402
from testkit import triton_interpreter  # noqa: E402

triton_interpreter.patch()
from cachegw.backend.executor.layers.attention import AttentionMetadata, paged_attention_torch, store_kv_torch  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
BLOCK_SIZE = 16
# In the interpreter, triton's library functions (tl.max, tl.cdiv, ...) must be interpreted too.
KERNELS_HERE = ta.triton_available() and (
    ON_CUDA or (ta._INTERPRETED and type(ta.tl.cdiv).__name__ == "InterpretedFunction")
)
needs_triton = pytest.mark.skipif(
    not KERNELS_HERE,
    reason="triton is not installed"
    if ta.triton is None
    else "triton was imported before TRITON_INTERPRET was set: see test_kernels_in_fresh_process",
)
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}

# (query_lens, seq_lens): decodes first, then prefill chunks, as the engine orders them.
SCENARIOS = {
    "decode": ([1, 1, 1, 1], [1, 17, 40, 64]),
    "prefill": ([5, 16, 23], [5, 16, 23]),
    "prefix": ([7, 16, 70], [40, 33, 150]),  # 70 queries span two blocks of query rows even for MHA
    "mixed": ([1, 1, 9, 20], [31, 16, 9, 45]),
    "long_decode": ([1, 1, 1], [300, 129, 64]),  # several KV tiles, so KV splits really split
}
HEADS = {"mha": (4, 4), "gqa3": (9, 3)}  # (num_heads, num_kv_heads); the real model is 9/3, d=64


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, KVH, D]: this step's new keys, not yet in the cache
    value: torch.Tensor
    k_cache: torch.Tensor  # holds every sequence's prefix; unused slots hold `garbage`
    v_cache: torch.Tensor
    meta: AttentionMetadata
    dense_k: list[torch.Tensor]  # per sequence [ctx, KVH, D]
    dense_v: list[torch.Tensor]


def make_case(
    query_lens: list[int],
    seq_lens: list[int],
    heads: tuple[int, int],
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    garbage: float = float("nan"),
    seed: int = 0,
    kv: str = "auto",
    align: int = 1,
) -> Case:
    """Random step with shuffled, non-contiguous block tables; prefixes are already cached (as
    ``kv_cache_dtype = kv`` stores them: an int8 cache's unused slots hold zeros, not ``garbage``).
    ``align``: rows start that many elements apart, the padding between them filled with ``garbage``
    (int8: 99), as the engine lays out an int8 pool on CUDA (``kv_quant.row_align``)."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, kv_heads = heads
    nblocks = [(c + BLOCK_SIZE - 1) // BLOCK_SIZE for c in seq_lens]
    perm = torch.randperm(sum(nblocks) + 3, generator=gen)
    tables = torch.zeros(len(seq_lens), max(nblocks), dtype=torch.int32)
    used = 0
    for s, n in enumerate(nblocks):
        tables[s, :n] = perm[used : used + n]
        used += n
    fmt = kv_quant.KVCacheFormat(kv, dtype, head_dim, align)
    shape = (len(perm), BLOCK_SIZE, kv_heads, fmt.stored_width)
    fill = 0.0 if kv == "int8" else garbage

    def pool() -> torch.Tensor:
        rows = torch.full(shape, fill, dtype=dtype).to(fmt.storage_dtype)
        rows[..., fmt.row_width :] = 99 if kv == "int8" else garbage
        return rows

    k_pool, v_pool = pool(), pool()
    k_cache, v_cache = k_pool[..., : fmt.row_width], v_pool[..., : fmt.row_width]

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype)

    dense_k = [rand(c, kv_heads, head_dim) for c in seq_lens]
    dense_v = [rand(c, kv_heads, head_dim) for c in seq_lens]
    pieces: dict[str, list[torch.Tensor]] = {
        "k": [],
        "v": [],
        "slots": [],
        "new_k": [],
        "new_v": [],
        "new_slots": [],
    }
    for s, (q_len, ctx) in enumerate(zip(query_lens, seq_lens, strict=True)):
        pos = torch.arange(ctx)
        slots = tables[s, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        cached = ctx - q_len
        for kind, full in (("k", dense_k[s]), ("v", dense_v[s]), ("slots", slots)):
            pieces[kind].append(full[:cached])
            pieces["new_" + kind].append(full[cached:])
    cat = {name: torch.cat(parts) for name, parts in pieces.items()}
    store_kv_torch(cat["k"], cat["v"], k_cache, v_cache, cat["slots"])
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=cat["new_slots"],
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens)),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    return Case(
        q=rand(sum(query_lens), num_heads, head_dim).to(DEVICE),
        key=cat["new_k"].to(DEVICE),
        value=cat["new_v"].to(DEVICE),
        k_cache=k_pool.to(DEVICE)[..., : fmt.row_width],  # (a view's .to() would close its gaps)
        v_cache=v_pool.to(DEVICE)[..., : fmt.row_width],
        meta=meta,
        dense_k=dense_k,
        dense_v=dense_v,
    )


def dense_attention(case: Case, scale: float, window: int | None = None) -> torch.Tensor:
    """Per sequence: dense K/V, explicit causal (and window) mask over absolute positions, softmax
    in float64."""
    outs = []
    starts = case.meta.query_start_loc.tolist()
    for s, (q_len, ctx) in enumerate(zip(case.meta.query_lens_cpu, case.meta.seq_lens_cpu, strict=True)):
        q = case.q[starts[s] : starts[s] + q_len].double().cpu().transpose(0, 1)  # [H, q_len, D]
        group = q.shape[0] // case.dense_k[s].shape[1]
        k = case.dense_k[s].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
        v = case.dense_v[s].double().repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(ctx - q_len, ctx)
        mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= torch.arange(ctx)[None, :] > q_pos[:, None] - window
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
        outs.append((scores.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outs)


def run_triton(
    case: Case, scale: float, num_splits: int | None = None, window: int | None = None
) -> torch.Tensor:
    ta.store_kvcache(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = ta.paged_attention_triton(
        case.q, case.k_cache, case.v_cache, case.meta, scale, num_splits=num_splits, window=window
    )
    return out.double().cpu()


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return (out - ref).abs().max().item()


@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_torch_path_matches_dense(scenario: str, heads: str) -> None:
    # The torch decode path multiplies masked-out slots by zero, so unused slots must be finite here.
    case = make_case(*SCENARIOS[scenario], HEADS[heads], garbage=3.0)
    store_kv_torch(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, 0.125, case.key, case.value)
    assert max_err(out.double().cpu(), dense_attention(case, 0.125)) < 1e-4


def forget_blocks_before_window(case: Case, window: int, fill: float = float("nan")) -> None:
    """Fill every block wholly before each sequence's window, as if the engine had freed it and
    another sequence had written there: such blocks must never be read (the kernels), or only
    read and masked out (the torch path's padded decode groups: a finite fill there)."""
    for s, (q_len, ctx) in enumerate(zip(case.meta.query_lens_cpu, case.meta.seq_lens_cpu, strict=True)):
        for b in range(max(0, ctx - q_len - window + 1) // BLOCK_SIZE):
            block = case.meta.block_tables[s, b]
            case.k_cache[block] = fill
            case.v_cache[block] = fill


# A window of 1 sees only the query itself; 16 and 24 fall on and between block edges.
WINDOWS = [1, 16, 24]
# Decodes of one padded group whose windows start in different blocks.
WINDOW_SCENARIOS = {**SCENARIOS, "grouped_decode": ([1, 1, 1], [50, 60, 64])}


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("scenario", list(WINDOW_SCENARIOS))
def test_torch_path_sliding_window(scenario: str, window: int) -> None:
    case = make_case(*WINDOW_SCENARIOS[scenario], HEADS["gqa3"], garbage=3.0)
    forget_blocks_before_window(case, window, fill=1.0e4)
    store_kv_torch(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    args = (case.q, case.k_cache, case.v_cache, case.meta, 0.125)
    out = paged_attention_torch(*args, case.key, case.value, window=window).double().cpu()
    assert max_err(out, dense_attention(case, 0.125, window)) < 1e-4
    if max(case.meta.seq_lens_cpu) > window:  # the window matters here: full attention differs
        assert (out - dense_attention(case, 0.125)).abs().max() > 1e-2


@needs_triton
@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("scenario", list(WINDOW_SCENARIOS))
def test_triton_sliding_window(scenario: str, window: int, num_splits: int | None) -> None:
    case = make_case(*WINDOW_SCENARIOS[scenario], HEADS["gqa3"])  # unused slots are NaN: must never be read
    forget_blocks_before_window(case, window)
    out = run_triton(case, 0.125, num_splits=num_splits, window=window)
    assert max_err(out, dense_attention(case, 0.125, window)) < 1e-4


@needs_triton
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_triton_matches_references(scenario: str, heads: str) -> None:
    case = make_case(*SCENARIOS[scenario], HEADS[heads])  # unused slots are NaN: must never be read
    out = run_triton(case, 0.125)
    assert max_err(out, dense_attention(case, 0.125)) < 1e-4
    finite = make_case(*SCENARIOS[scenario], HEADS[heads], garbage=3.0)
    store_kv_torch(finite.key, finite.value, finite.k_cache, finite.v_cache, finite.meta.slot_mapping)
    ref = paged_attention_torch(finite.q, finite.k_cache, finite.v_cache, finite.meta, 0.125)
    assert max_err(out, ref.double().cpu()) < 1e-4


@needs_triton
@pytest.mark.parametrize("num_splits", [2, 8])
@pytest.mark.parametrize("scenario", ["long_decode", "mixed"])
def test_triton_kv_splits(scenario: str, num_splits: int) -> None:
    # Short contexts leave most splits empty; the merge must ignore them.
    case = make_case(*SCENARIOS[scenario], HEADS["gqa3"])
    out = run_triton(case, 0.125, num_splits=num_splits)
    assert max_err(out, dense_attention(case, 0.125)) < 1e-4


@needs_triton
@pytest.mark.parametrize("head_dim", [32, 128, 256, 80])
def test_triton_head_dims(head_dim: int) -> None:
    case = make_case([1, 6], [20, 19], HEADS["gqa3"], head_dim=head_dim)
    out = run_triton(case, head_dim**-0.5)
    assert max_err(out, dense_attention(case, head_dim**-0.5)) < 1e-4


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_triton_half_precision(scenario: str, dtype: torch.dtype) -> None:
    case = make_case(*SCENARIOS[scenario], HEADS["gqa3"], dtype=dtype)
    out = run_triton(case, 0.125)
    assert ta.paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, 0.125).dtype == dtype
    assert max_err(out, dense_attention(case, 0.125)) < TOL[dtype]


@needs_triton
def test_padding_sequence_gives_zeros() -> None:
    # CUDA-graph batches pad with sequences of no context; they must come out finite, not NaN.
    case = make_case([1, 1], [12, 1], HEADS["gqa3"])
    case.meta.seq_lens[1] = 0
    ta.store_kvcache(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = ta.paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, 0.125)
    assert torch.isfinite(out).all() and not out[1].any()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_skips_negative_slots(dtype: torch.dtype) -> None:
    tokens, kv_heads, head_dim, num_blocks = 7, 3, 64, 4
    qkv = torch.randn(tokens, 3 * kv_heads, head_dim).to(dtype).to(DEVICE)
    key, value = qkv[:, :kv_heads], qkv[:, kv_heads : 2 * kv_heads]  # strided views, as after a QKV split
    slots = torch.tensor([5, -1, 17, 63, -1, 0, 40], device=DEVICE)
    k_cache = torch.full((num_blocks, BLOCK_SIZE, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    ta.store_kvcache(key, value, k_cache, v_cache, slots)
    keep = slots >= 0
    k_ref, v_ref = torch.full_like(k_cache, 7.0), torch.full_like(v_cache, 7.0)
    store_kv_torch(key[keep], value[keep], k_ref, v_ref, slots[keep])
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_triton_available_matches_import() -> None:
    assert ta.triton_available() == (ta.triton is not None)


@pytest.mark.skipif(
    ta.triton is None or KERNELS_HERE, reason="no triton, or the kernel tests run in this process"
)
def test_kernels_in_fresh_process() -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    here = Path(__file__).resolve()
    files = [str(here), str(here.with_name("test_triton_kv_formats.py"))]  # its kernel tests skip here too
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:]


@pytest.mark.cuda
@pytest.mark.skipif(not (ON_CUDA and ta.triton_available()), reason="needs CUDA and triton")
def test_cuda_graph_decode_replay() -> None:
    """Store + decode attention captured once, replayed with longer contexts and new slots."""
    case = make_case([1] * 8, [40] * 8, HEADS["gqa3"], garbage=0.0)
    meta, scale = case.meta, 0.125
    warm = torch.cuda.Stream()
    with torch.cuda.stream(warm):
        run_triton(case, scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.store_kvcache(case.key, case.value, case.k_cache, case.v_cache, meta.slot_mapping)
        out = ta.paged_attention_triton(case.q, case.k_cache, case.v_cache, meta, scale)
    fresh = make_case([1] * 8, [41, 9, 33, 17, 48, 2, 30, 47], HEADS["gqa3"], garbage=0.0, seed=1)
    for dst, src in ((case.q, fresh.q), (case.key, fresh.key), (case.value, fresh.value)):
        dst.copy_(src)
    case.k_cache[: len(fresh.k_cache)].copy_(fresh.k_cache)  # fresh needs fewer blocks
    case.v_cache[: len(fresh.v_cache)].copy_(fresh.v_cache)
    meta.seq_lens.copy_(fresh.meta.seq_lens)
    meta.slot_mapping.copy_(fresh.meta.slot_mapping)
    meta.block_tables.copy_(fresh.meta.block_tables)
    graph.replay()
    torch.cuda.synchronize()
    assert max_err(out.double().cpu(), dense_attention(fresh, scale)) < 1e-4


@pytest.mark.cuda
@pytest.mark.skipif(not (ON_CUDA and ta.triton_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("batch,ctx", [(1, 4096), (64, 1024)])
def test_cuda_decode_speed(batch: int, ctx: int) -> None:
    """Prints Triton vs torch decode times (pytest -s); checks only that the result stays right."""
    case = make_case([1] * batch, [ctx] * batch, HEADS["gqa3"], dtype=torch.bfloat16, garbage=0.0)
    ta.store_kvcache(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)

    def bench(fn) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20 * 1e3

    args = (case.q, case.k_cache, case.v_cache, case.meta, 0.125)
    t_triton = bench(lambda: ta.paged_attention_triton(*args))
    t_torch = bench(lambda: paged_attention_torch(*args))
    print(f"\ndecode batch={batch} ctx={ctx}: triton {t_triton:.1f} us, torch {t_torch:.1f} us")
    out = ta.paged_attention_triton(*args).double().cpu()
    assert max_err(out, dense_attention(case, 0.125)) < TOL[torch.bfloat16]
