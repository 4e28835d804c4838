"""The quantized KV cache (``[engine] kv_cache_dtype``, layers/kv_quant.py) without the real model:
the int8/fp8 round trip through the torch path's store and reads, capacity counted in stored bytes, the
tier's block files carrying the scales, and the config check. The runner tests use a tiny random-weight
Llama (load_format "dummy") with SmolLM2's head_dim of 64; the real model's greedy tokens are checked in
tests/test_engine_features.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from cachegw.backend.config import load_engine_config
from cachegw.backend.core.block_manager import BlockManager
from cachegw.backend.core.kv_disk import BlockFormat, decode, encode
from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.core.scheduler import ScheduledBatch
from cachegw.backend.core.sequence import Sequence
from cachegw.backend.executor.layers import kv_quant
from cachegw.backend.executor.layers.attention import _gather_blocks, read_blocks, store_kv_torch
from cachegw.backend.executor.model_runner import ModelRunner
from cachegw.backend.executor.models.llama import ModelSpec

BS = 4


def stored(kind: str, key: torch.Tensor, value: torch.Tensor, blocks: int = 8):
    """Caches of ``kind`` holding key/value [T, KVH, D] at slots 0..T-1."""
    fmt = kv_quant.KVCacheFormat(kind, key.dtype, key.shape[-1])
    shape = (blocks, BS, key.shape[1], fmt.row_width)
    k_cache = torch.zeros(shape, dtype=fmt.storage_dtype)
    v_cache = torch.zeros(shape, dtype=fmt.storage_dtype)
    store_kv_torch(key, value, k_cache, v_cache, torch.arange(key.shape[0]))
    return k_cache, v_cache


def rows(cache: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    blocks = torch.arange(cache.shape[0])
    return read_blocks(cache, blocks, dtype).flatten(0, 1)[:n]


def test_int8_round_trip_is_within_half_a_step_of_each_rows_own_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(30, 3, 64, generator=gen) * torch.logspace(-2, 2, 30)[:, None, None]
    key[7, 1, 5] = 300.0  # one outlier spoils only its own (token, head) row
    value = torch.randn(30, 3, 64, generator=gen)
    k_cache, v_cache = stored("int8", key, value)
    assert k_cache.dtype == torch.int8 and k_cache.shape[-1] == 66
    absmax = key.abs().amax(-1, keepdim=True)
    scales = k_cache.flatten(0, 1)[:30, :, 64:].contiguous().view(torch.float16).float()
    torch.testing.assert_close(scales, absmax / 127, rtol=1e-3, atol=0)
    # Half a step of the row's own scale, plus the float16 scale's rounding (127 x 2^-11 of a step).
    step = 0.5 / 127 + 2**-11
    assert ((rows(k_cache, 30) - key).abs() <= absmax * step).all()
    assert ((rows(v_cache, 30) - value).abs() <= value.abs().amax(-1, keepdim=True) * step).all()
    assert (rows(k_cache, 30)[6] - key[6]).abs().max() < 0.05  # the outlier's neighbour keeps its precision
    # The decode path's gather reads the same values.
    gathered = _gather_blocks(k_cache, torch.tensor([[0, 1]]), "k", torch.float32).flatten(1, 2)[0]
    torch.testing.assert_close(gathered, rows(k_cache, 8), rtol=0, atol=0)


def test_int8_bfloat16_compute_reads_back_bfloat16() -> None:
    key = torch.randn(5, 2, 64).bfloat16()
    k_cache, _ = stored("int8", key, key)
    back = rows(k_cache, 5, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert (back.float() - key.float()).abs().max() <= key.float().abs().max() * (0.5 / 127 + 2**-8)


def test_fp8_round_trip_and_saturation() -> None:
    key = torch.randn(9, 2, 64) * 10
    key[0, 0, 0], key[0, 0, 1] = 1000.0, -1000.0
    k_cache, _ = stored("fp8", key, key)
    assert k_cache.dtype == torch.float8_e4m3fn and k_cache.shape[-1] == 64
    back = rows(k_cache, 9)
    assert back[0, 0, 0] == 448.0 and back[0, 0, 1] == -448.0  # saturated, never NaN
    inside = key.abs() <= 448
    assert ((back - key).abs()[inside] <= key.abs()[inside] * 2**-4 + 2**-9).all()


SMOL = ModelSpec("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 8192, True, False, False, False)


def test_bytes_per_token_count_values_and_scales() -> None:
    f32, bf16 = SMOL.kv_bytes_per_token(torch.float32), SMOL.kv_bytes_per_token(torch.bfloat16)
    int8, fp8 = SMOL.kv_bytes_per_token(torch.float32, "int8"), SMOL.kv_bytes_per_token(torch.bfloat16, "fp8")
    assert (f32, bf16, int8, fp8) == (46080, 23040, 2 * 30 * 3 * 66, 2 * 30 * 3 * 64)
    assert bf16 / int8 > 1.9 and f32 / int8 > 3.8 and f32 / fp8 == 4


def tiny_runner(kind: str, **overrides) -> ModelRunner:
    hf = LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        architectures=["LlamaForCausalLM"],
    )  # head_dim 64, as SmolLM2's
    cfg = load_engine_config(
        load_format="dummy", device="cpu", dtype="float32", block_size=BS, kv_cache_dtype=kind, **overrides
    )
    return ModelRunner(cfg, hf, None, torch.device("cpu"), torch.float32, max_model_len=128)


def test_the_same_byte_budget_holds_four_times_the_float32_tokens() -> None:
    budget = 1 << 20
    blocks = {kind: tiny_runner(kind, kv_cache_bytes=budget).num_blocks for kind in ("auto", "int8", "fp8")}
    assert blocks["fp8"] == 4 * blocks["auto"]
    assert 3.8 < blocks["int8"] / blocks["auto"] < 3.9  # 66 bytes a row against 256


PROMPT = [5, 9, 2, 33, 17, 8, 40, 3, 11, 60, 21]


def run_steps(runner: ModelRunner) -> tuple[torch.Tensor, Sequence]:
    """Chunked prefill of PROMPT, then two greedy decodes: every step's logits, and the sequence."""
    bm = BlockManager(runner.num_blocks, BS, enable_prefix_caching=False)
    seq = Sequence("s", list(PROMPT), SamplingParams())
    logits = []
    for n in (6, 5, 1, 1):
        if seq.block_table:
            bm.append_slots(seq, n)
        else:
            bm.allocate(seq, [], n)
        step = runner.execute(ScheduledBatch([seq], [n]))
        seq.num_computed_tokens += n
        if step.logits.numel():
            logits.append(step.logits)
            seq.token_ids.append(int(step.logits.argmax()))
    return torch.cat(logits), seq


def test_int8_runner_logits_follow_float32_and_blocks_move_with_their_scales() -> None:
    """Chunked prefill then decodes over the cache (the reads that dequantize): int8 KV stays close to
    float32 KV; a block read out (as the RAM/disk tier does) and written elsewhere reads back the same."""
    out = {}
    for kind in ("auto", "int8"):
        runner = tiny_runner(kind, kv_cache_tokens=64)
        out[kind], seq = run_steps(runner)
        if kind == "int8":
            data = runner.read_block(seq.block_table[0])
            assert data.dtype == torch.int8 and data.shape == (2, 2, BS, 1, 66)
            fmt = BlockFormat("tiny", data.dtype, tuple(data.shape))
            raw = encode(fmt, b"h" * 32, data)
            assert len(raw) > fmt.payload_bytes == data.numel()
            loaded = decode(fmt, b"h" * 32, raw)
            assert loaded is not None
            spare = runner.num_blocks - 1
            runner.write_block(spare, loaded)
            k = runner.kv_caches[0][0]
            torch.testing.assert_close(
                read_blocks(k, torch.tensor([spare]), torch.float32),
                read_blocks(k, torch.tensor([seq.block_table[0]]), torch.float32),
            )
    assert (out["int8"] - out["auto"]).abs().max() < 0.05 * out["auto"].abs().max()
    assert not torch.equal(out["int8"], out["auto"])  # the int8 cache was really read


def test_aligned_int8_rows_change_only_where_rows_start(monkeypatch) -> None:
    """Rows padded to 16 bytes apart, as on CUDA (``kv_quant.row_align``): the same logits to the bit, the
    same 66-byte rows for the tiers, the padding counted in the pool's bytes and never written."""
    plain = tiny_runner("int8", kv_cache_tokens=64)
    want, _ = run_steps(plain)
    monkeypatch.setattr(kv_quant, "row_align", lambda kind, device: 16)
    budget = 1 << 20
    assert tiny_runner("int8", kv_cache_bytes=budget).num_blocks == budget // (2 * 2 * BS * 80)
    runner = tiny_runner("int8", kv_cache_tokens=64)
    k = runner.kv_caches[0][0]
    assert k.shape[-1] == 66 and k.stride(-2) == 80 and runner.kv_bytes_per_token == 2 * 2 * 80
    got, seq = run_steps(runner)
    assert torch.equal(got, want)
    assert runner.read_block(seq.block_table[0]).shape == (2, 2, BS, 1, 66)
    assert torch.equal(runner.read_block(seq.block_table[0]), plain.read_block(seq.block_table[0]))
    whole = k.as_strided((k.shape[0], BS, 1, 80), (BS * 80, 80, 80, 1))
    assert whole[..., 66:].count_nonzero() == 0 and whole[..., :66].count_nonzero() > 0


def test_kv_cache_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'.*kv_cache_dtype is one of auto, int8, fp8"):
        load_engine_config(kv_cache_dtype="int4")
    kv_quant.check_supported("fp8", torch.device("cpu"))  # torch converts to e4m3 on this CPU
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported by this torch on meta"):
        kv_quant.check_supported("fp8", torch.device("meta"))  # a device that cannot give the values back
