"""The modules' ops on cachegw's kernels (cpu_kernels_modules.h): each row's result has the same bits
whatever else shares the step, and agrees with torch's own arithmetic to float32 rounding.

A prompt's row is computed in a prefill chunk of hundreds, after a prefix hit in a chunk of a few, or
alone as a decode; attention of a row in a chunk must equal the decode kernel's for that row, the norm
and SiLU of a row must not follow the row count (torch's do not promise it: their reductions and vector
tails follow the tensor's size and the thread split)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cachegw.backend.executor.layers import cpu_kernels

STATUS = cpu_kernels.choose("auto")
pytestmark = pytest.mark.skipif(not STATUS.available, reason=f"cachegw's CPU kernels: {STATUS.reason}")
BUILDS = [name for name in cpu_kernels.BUILDS if cpu_kernels.load(name).available]


def _ops(build: str):
    return getattr(torch.ops, f"cachegw_{build}")


@pytest.mark.parametrize("build", BUILDS)
def test_norm_and_silu_rows_do_not_follow_the_row_count(build: str) -> None:
    ops, g = _ops(build), torch.Generator().manual_seed(0)
    x, res, w = (torch.randn(300, 576, generator=g) for _ in range(3))
    w = w[0]
    out, added = ops.rms_norm(x, res, w, 1e-5)
    assert torch.equal(added, res + x)
    h = added * torch.rsqrt(added.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out, w * h, rtol=1e-5, atol=1e-5)
    gu = torch.randn(300, 2 * 1536, generator=g) * 4
    act = ops.silu_mul(gu)
    torch.testing.assert_close(act, F.silu(gu[:, :1536]) * gu[:, 1536:], rtol=1e-5, atol=1e-5)
    for at in (0, 7, 299):
        for rows in (slice(at, at + 1), slice(max(0, at - 2), at + 3)):
            i = at - rows.start
            assert torch.equal(ops.rms_norm(x[rows], res[rows], w, 1e-5)[0][i], out[at])
            assert torch.equal(ops.rms_norm(added[rows], torch.empty(0), w, 1e-5)[0][i], out[at])
            assert torch.equal(ops.silu_mul(gu[rows])[i], act[at])


def _attention_ref(q, k, v, window: int) -> torch.Tensor:
    """Causal attention of q [T, H, D] over k, v [T, KVH, D] in float64 (query t at position t)."""
    t, heads, d = q.shape
    group = heads // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * d**-0.5
    pos = torch.arange(t)
    seen = pos[None, :] <= pos[:, None]
    if window:
        seen &= pos[None, :] > pos[:, None] - window
    out = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v
    return out.transpose(0, 1).float()


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_every_row_of_a_chunk_is_its_decode(build: str, window: int, kv: str) -> None:
    """Two sequences in paged blocks of 8 (shuffled): a 70-token prompt in one chunk, and a 50-token one
    whose last 13 rows come as a chunk after its cached first 37; every row equals the decode kernel's
    result for that row alone, and the float64 reference to float32 rounding. int8: the cache holds
    kv_quant's rows, the reference their dequantized values."""
    from cachegw.backend.executor.layers import kv_quant

    def stored(x: torch.Tensor) -> torch.Tensor:  # as the cache keeps x
        return kv_quant.encode(x, torch.int8) if kv == "int8" else x

    def exact(x: torch.Tensor) -> torch.Tensor:  # the values the cache gives back for x
        return x if kv == "float32" else kv_quant.decode(stored(x), torch.int8, torch.empty_like(x))

    ops, g = _ops(build), torch.Generator().manual_seed(window)
    heads, kv_heads, d, bs = 6, 2, 64, 8
    lengths, chunks = (70, 50), (70, 13)
    tables = torch.randperm(20, generator=g, dtype=torch.int32)[:18].view(2, 9).contiguous()
    k_cache, v_cache = torch.zeros(20, bs, kv_heads, d), torch.zeros(20, bs, kv_heads, d)
    qs, rows = [], []
    for s, n in enumerate(lengths):
        q, k, v = (
            torch.randn(n, heads, d, generator=g),
            *(exact(torch.randn(n, kv_heads, d, generator=g)) for _ in "kv"),
        )
        for p in range(n):
            block = int(tables[s, p // bs])
            k_cache[block, p % bs], v_cache[block, p % bs] = k[p], v[p]
        torch.testing.assert_close(
            ops.paged_attention(q, stored(k_cache), stored(v_cache), tables[s : s + 1].contiguous(),
                                torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                                d**-0.5, window),
            _attention_ref(q, k, v, window), rtol=1e-4, atol=1e-5)  # fmt: skip
        qs.append(q[n - chunks[s] :])
        rows += [(s, p) for p in range(n - chunks[s], n)]
    k_cache, v_cache = stored(k_cache), stored(v_cache)
    out = ops.paged_attention(
        torch.cat(qs), k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32),
        torch.tensor([0, chunks[0], sum(chunks)], dtype=torch.int32), d**-0.5, window,
    )  # fmt: skip
    q_all = torch.cat(qs)
    for i, (s, p) in enumerate(rows):
        alone = ops.paged_decode_attention(
            q_all[i : i + 1].contiguous(), k_cache, v_cache, tables[s : s + 1].contiguous(),
            torch.tensor([p + 1], dtype=torch.int32), d**-0.5, window,
        )  # fmt: skip
        assert torch.equal(out[i], alone[0]), (s, p)
