"""A row's output from cachegw's CPU kernels does not depend on how many rows share its step.

Every path (the decode path for a few rows, the prefill tile from 32) rounds the activations per
block of 32 and runs one float sequence per output (cpu_kernels.cpp), so a row computed alone (a
decode), among a few rows (batched decodes) or inside a prefill of hundreds gives the same bits. A
prefix-cache hit changes how many rows a prompt's last tokens share a step with; were the bits to
follow the row count, the hit would change greedy tokens. Each build this CPU can run, 4- and 8-bit
weights, an output count that leaves a part-filled last tile (50, 70) and K past the unrolling
(576, 1536: 9 and 24 block pairs)."""

from __future__ import annotations

import pytest
import torch

from cachegw.backend.executor.layers import cpu_kernels
from cachegw.backend.executor.layers.quantized_linear import BlockLinear

STATUS = cpu_kernels.choose("auto")
pytestmark = pytest.mark.skipif(not STATUS.available, reason=f"cachegw's CPU kernels: {STATUS.reason}")
BUILDS = [name for name in cpu_kernels.BUILDS if cpu_kernels.load(name).available]
BATCHES = (2, 7, 33, 100)


def _op(build: str):
    return getattr(torch.ops, f"cachegw_{build}").block_linear


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k"), [(50, 576), (70, 1536)])
def test_a_row_has_the_same_bits_alone_and_in_any_batch(build: str, bits: int, n: int, k: int) -> None:
    """One row alone, then at the front, the middle and the end of batches of 2, 7, 33 and 100
    other rows (the decode path up to 31 rows, the prefill tile from 32, part-filled lane tiles):
    torch.equal every time."""
    g = torch.Generator().manual_seed(n + k + bits)
    layer = BlockLinear.from_float(torch.randn(n, k, generator=g) * 0.05, None, bits, f"cachegw_{build}")
    op = _op(build)
    row = torch.randn(1, k, generator=g)
    row[0, 7] = 40.0  # an outlier in one block: its rounding must not depend on neighbours either
    alone = op(row, layer.w, layer.d, layer.m, bits)
    for rows in BATCHES:
        batch = torch.randn(rows, k, generator=g)
        for at in sorted({0, rows // 2, rows - 1}):
            x = batch.clone()
            x[at] = row[0]
            y = op(x, layer.w, layer.d, layer.m, bits)
            assert torch.equal(y[at], alone[0]), (rows, at)
    ref = row @ layer.dequantized().T
    assert ((alone - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.parametrize("bits", [4, 8])
def test_every_row_of_a_prefill_equals_its_decode(bits: int) -> None:
    """All 100 rows at once against each computed alone, and every build against the first: the
    same bits (a prompt prefilled on one build and decoded on another would match too)."""
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(70, 576, generator=g) * 0.05
    layer = BlockLinear.from_float(w, None, bits, f"cachegw_{BUILDS[0]}")
    x = torch.randn(100, 576, generator=g)
    first = None
    for build in BUILDS:
        op = _op(build)
        together = op(x, layer.w, layer.d, layer.m, bits)
        one_by_one = torch.cat([op(x[i : i + 1], layer.w, layer.d, layer.m, bits) for i in range(len(x))])
        assert torch.equal(together, one_by_one), build
        first = together if first is None else first
        assert torch.equal(together, first), build
