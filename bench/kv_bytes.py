"""KV-cache bytes per token for MHA, GQA, MQA and latent attention (MLA), side by side.

``tiny``: four small models of one width (8 query heads of 32, 4 layers; dummy weights from a
config.json alone), each started as a real engine in bfloat16: bytes per token are the pool tensors
the runner allocated divided by the tokens they hold, checked against the figure the engine sizes its
pool by (``ModelSpec.kv_bytes_per_token``). ``published``: the same sizing for published shapes,
their config values typed in here (no download, no weights): SmolLM2-135M and Llama-3-8B (GQA),
DeepSeek-V2-Lite and DeepSeek-V3 (MLA). Beside every model, what a K and a V for every query head
would keep (MHA; for MLA, keys of qk_nope + qk_rope and values of v_head_dim per head): what GQA, MQA
and MLA save.

    .venv/bin/python -m bench.kv_bytes
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from bench.common import save, say

BF16 = 2
TINY: dict[str, Any] = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8
)


def _tiny_configs() -> dict[str, object]:
    from transformers import DeepseekV2Config, LlamaConfig

    llama: dict[str, Any] = {**TINY, "head_dim": 32}
    mla = DeepseekV2Config(
        **TINY, q_lora_rank=None, kv_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        first_k_dense_replace=4,
    )  # fmt: skip
    mla.architectures = ["DeepseekV2ForCausalLM"]
    configs: dict[str, object] = {
        "MHA (8 KV heads)": LlamaConfig(**llama, num_key_value_heads=8),
        "GQA (2 KV heads)": LlamaConfig(**llama, num_key_value_heads=2),
        "MQA (1 KV head)": LlamaConfig(**llama, num_key_value_heads=1),
        "MLA (latent 128 + rope 16)": mla,
    }
    for cfg in configs.values():
        if not getattr(cfg, "architectures", None):
            cfg.architectures = ["LlamaForCausalLM"]  # type: ignore[attr-defined]
    return configs


def _published() -> dict[str, tuple[str, object]]:
    """Config values as the models publish them (attention-relevant fields; the rest is not read)."""
    from transformers import DeepseekV2Config, DeepseekV3Config, LlamaConfig

    smol = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152,
    )  # fmt: skip
    llama3 = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256,
    )  # fmt: skip
    lite = DeepseekV2Config(
        hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
        vocab_size=102400, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128,
        first_k_dense_replace=1, n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
        n_shared_experts=2,
    )  # fmt: skip
    v3 = DeepseekV3Config(
        hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
        vocab_size=129280, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, first_k_dense_replace=3, n_routed_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=2048, n_shared_experts=1, n_group=8, topk_group=4,
    )  # fmt: skip
    for cfg, arch in ((smol, "Llama"), (llama3, "Llama"), (lite, "DeepseekV2"), (v3, "DeepseekV3")):
        cfg.architectures = [f"{arch}ForCausalLM"]
    return {
        "SmolLM2-135M": ("GQA", smol),
        "Llama-3-8B": ("GQA", llama3),
        "DeepSeek-V2-Lite": ("MLA", lite),
        "DeepSeek-V3": ("MLA", v3),
    }


def _per_head_kv(spec) -> int:
    """Bytes per token (bf16) with a K and a V for every query head, as MHA keeps them (MLA's keys are
    nope + rope wide, its values v_head_dim): what GQA, MQA and MLA each save against."""
    from cachegw.backend.executor.models.deepseek import MLASpec

    if not isinstance(spec, MLASpec):
        return 2 * spec.num_layers * spec.num_heads * spec.head_dim * BF16
    width = spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim
    return spec.num_layers * spec.num_heads * width * BF16


def tiny() -> list[dict]:
    from cachegw.backend import LLM

    rows = []
    for name, cfg in _tiny_configs().items():
        with tempfile.TemporaryDirectory() as tmp:
            cfg.save_pretrained(tmp)  # type: ignore[attr-defined]
            llm = LLM(model=tmp, load_format="dummy", dtype="bfloat16", kv_cache_tokens=1024, compile="off")
            runner = llm.engine.runner
            allocated = sum(t.numel() * t.element_size() for parts in runner.kv_caches for t in parts)
            per_token = allocated // (runner.num_blocks * runner.block_size)
            assert per_token == runner.kv_bytes_per_token, (name, per_token, runner.kv_bytes_per_token)
            rows.append(
                {
                    "model": name,
                    "pool_shape_per_layer": [list(t.shape) for t in runner.kv_caches[0]],
                    "bytes_per_token": per_token,
                    "per_head_kv_bytes": _per_head_kv(runner.spec),
                }
            )
            say(f"{name}: {per_token} B/token, pool per layer {rows[-1]['pool_shape_per_layer']}")
            del llm
    return rows


def published() -> list[dict]:
    from cachegw.backend.config import load_engine_config
    from cachegw.backend.executor.models.registry import model_spec

    engine = load_engine_config()
    rows = []
    for name, (kind, cfg) in _published().items():
        spec = model_spec(cfg, engine)
        per_token = spec.kv_bytes_per_token(torch.bfloat16)
        rows.append(
            {
                "model": name,
                "attention": kind,
                "layers": spec.num_layers,
                "query_heads": spec.num_heads,
                "row": f"{spec.kv_parts} x {spec.num_kv_heads} x {spec.head_dim}",
                "bytes_per_token": per_token,
                "per_head_kv_bytes": _per_head_kv(spec),
                "tokens_per_gib": (1 << 30) // per_token,
            }
        )
        say(f"{name}: {per_token} B/token ({rows[-1]['per_head_kv_bytes']} with K/V per query head)")
    return rows


def main() -> None:
    save("kv_bytes", {"dtype": "bfloat16", "tiny_engines": tiny(), "published_shapes": published()})


if __name__ == "__main__":
    main()
