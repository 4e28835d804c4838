"""The GGUF loads straight into the quantized layers: the tensor table matches gguf's own reader,
and an engine under the default mode holds no float projection and no unfilled (meta) tensor."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGUFReader

from cachegw.backend.executor.gguf_table import read_table
from cachegw.backend.executor.host_memory import zeros_on_demand
from cachegw.backend.executor.model_loader import embedded_gguf_path


def test_tensor_table_matches_gguf_s_reader() -> None:
    path = embedded_gguf_path()
    arch, ours = read_table(path)
    theirs = GGUFReader(str(path)).tensors
    assert arch == "llama" and len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.name, a.tensor_type, a.data.shape, a.data.dtype) == (
            b.name,
            b.tensor_type,
            b.data.shape,
            b.data.dtype,
        )
        assert np.array_equal(a.data, b.data)


def test_default_engine_loads_no_float_projection(shared_engine) -> None:
    model = shared_engine.engine.runner.model
    assert shared_engine.engine.runner.quantization == "int4"
    tensors = [*model.parameters(), *model.buffers()]
    assert not any(t.is_meta for t in tensors)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    floats = sum(t.numel() for t in tensors if t.is_floating_point() and t.element_size() >= 2)
    # the embedding (49152 x 576) and norms, the rotary tables, the blocks' scales: not the projections
    assert floats < 60_000_000  # float projections would add about 106 million


def test_pool_pages_are_taken_on_first_write() -> None:
    def rss() -> int:
        status = open("/proc/self/status").read().splitlines()
        return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) * 1024

    before = rss()
    pool = zeros_on_demand((64, 1 << 20), torch.float32, torch.device("cpu"))  # 256 MiB
    assert rss() - before < 32 << 20 and float(pool[::4096].abs().sum()) == 0.0
    pool[0].fill_(1.0)
    assert float(pool.sum()) == 1 << 20
