"""The encoder's one-time export to ONNX: the transformer exported with torch's TorchScript exporter,
optionally fused by ORT's BERT optimizer, checked against torch on probe texts, written atomically
(embeddings/onnx_encoder.py explains why each step).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from cachegw.embeddings.onnx_cache import STALE_TEMP_S
from cachegw.embeddings.onnx_encoder import PROBE_MIN_COSINE, PROBE_TEXTS, Tokenizer, mean_pool_normalize

log = logging.getLogger(__name__)


def export_transformer(model_dir: Path, dest: Path, tokenizer: Tokenizer, optimize: bool) -> None:
    """Export the transformer to ``dest`` atomically, verified against torch on the probe texts.

    With ``optimize``, the graph fused by ORT's BERT optimizer (Attention, EmbedLayerNormalization,
    SkipLayerNormalization) is kept only if it matches torch as well; otherwise the plain one is written.
    """
    import onnx
    import torch
    from transformers import AutoModel

    t0 = time.perf_counter()
    log.info("exporting sentence encoder %s to ONNX (one time, a few seconds) -> %s", model_dir, dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(".export-*"):  # left by a process killed mid-export (90 MB each)
        if time.time() - stale.stat().st_mtime > STALE_TEMP_S:
            stale.unlink(missing_ok=True)
    # eager attention: plain matmul/softmax ops, and the mask graph ORT's attention fusion recognizes.
    model = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager", dtype=torch.float32).eval()

    class _Hidden(torch.nn.Module):
        """input_ids + attention_mask -> last_hidden_state; token types are all 0 for single sentences."""

        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            token_type_ids = torch.zeros_like(input_ids)
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state

    np_ids, np_mask = tokenizer.batch(PROBE_TEXTS)  # padded: the trace sees a real mask
    ids, mask = torch.from_numpy(np_ids), torch.from_numpy(np_mask)
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    ref = mean_pool_normalize(hidden, mask.numpy())

    fd, tmp_name = tempfile.mkstemp(prefix=".export-", suffix=".onnx", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # legacy-exporter deprecation and tracer warnings: benign here
            torch.onnx.export(
                _Hidden(model),
                (ids, mask),
                str(tmp),
                input_names=["input_ids", "attention_mask"],
                output_names=["last_hidden_state"],
                dynamic_axes={
                    "input_ids": {0: "batch", 1: "sequence"},
                    "attention_mask": {0: "batch", 1: "sequence"},
                    "last_hidden_state": {0: "batch", 1: "sequence"},
                },
                opset_version=17,
                dynamo=False,  # TorchScript exporter: needs neither onnxscript nor torch.export
            )
        proto = onnx.load(str(tmp))
        plain_cos = _ort_cosine(proto, tokenizer, ref)
        if not plain_cos >= PROBE_MIN_COSINE:  # NaN included
            raise RuntimeError(f"ONNX export disagrees with torch (probe cosine {plain_cos:.6f})")
        kind = "plain"
        if optimize:
            fused, stats = _fuse(proto, model.config)
            fused_cos = _ort_cosine(fused, tokenizer, ref) if fused is not None else float("nan")
            if fused is not None and fused_cos >= PROBE_MIN_COSINE:
                proto, kind = fused, f"fused {stats}"
            else:
                log.warning("ORT's BERT fusion misses torch (cosine %s); keeping the plain graph", fused_cos)
        meta = {"cachegw.probe": json.dumps(ref.round(7).tolist()), "cachegw.source": str(model_dir)}
        for key, value in meta.items():
            proto.metadata_props.add(key=key, value=value)
        with tmp.open("wb") as f:
            f.write(proto.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        tmp.chmod(0o644)  # mkstemp's 0600 would be odd for a cache file
        os.replace(tmp, dest)  # atomic: readers see the old file, no file, or the whole new one
    finally:
        tmp.unlink(missing_ok=True)
    mb = dest.stat().st_size / 1e6
    log.info("exported ONNX sentence encoder (%s, %.0f MB) in %.1fs", kind, mb, time.perf_counter() - t0)


def _fuse(proto: Any, config: Any) -> tuple[Any | None, str]:
    """ORT's offline BERT fusions (pure graph rewrites, fp32); ``None`` when the optimizer is unavailable."""
    try:
        from onnxruntime.transformers.optimizer import optimize_model
    except ImportError as exc:
        log.warning("onnxruntime.transformers unavailable (%s); exporting without fusion", exc)
        return None, ""
    # Its modules log each fusion at INFO under top-level names (fusion_base, onnx_model...): keep them quiet.
    noisy = [logging.getLogger(n) for n in ("fusion_base", "onnx_model", "onnx_model_bert", "fusion_utils")]
    levels = [lg.level for lg in noisy]
    for lg in noisy:
        lg.setLevel(logging.WARNING)
    try:
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "plain.onnx"
            src.write_bytes(proto.SerializeToString())
            opt = optimize_model(
                str(src),
                model_type="bert",
                num_heads=config.num_attention_heads,
                hidden_size=config.hidden_size,
                opt_level=0,  # Python fusions only: ORT's own level-ALL passes run at load, on the target CPU
                use_gpu=False,
            )
    finally:
        for lg, level in zip(noisy, levels, strict=True):
            lg.setLevel(level)
    counts = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
    stats = ", ".join(f"{k} {v}" for k, v in counts.items())
    return opt.model, stats


def _ort_cosine(proto: Any, tokenizer: Tokenizer, ref: np.ndarray) -> float:
    """Lowest cosine between ``ref`` and what ORT computes for the probe texts with ``proto``."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ids, mask = tokenizer.batch(PROBE_TEXTS)
    hidden = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    return float((mean_pool_normalize(hidden, mask) * ref).sum(axis=1).min())


def quantize_int8(fp32: Path, dest: Path) -> None:
    """``dest``: the exported ``fp32`` graph with int8 weights (per output channel: half the error of
    per-tensor scales), its probe metadata kept, written atomically."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    t0 = time.perf_counter()
    meta = {p.key: p.value for p in onnx.load(str(fp32), load_external_data=False).metadata_props}
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".export-", suffix=".onnx", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    root = logging.getLogger()
    was = root.disabled
    root.disabled = True  # the quantizer logs a "consider pre-processing" warning on the root logger
    try:
        quantize_dynamic(str(fp32), str(tmp), weight_type=QuantType.QInt8, per_channel=True)
        proto = onnx.load(str(tmp))
        del proto.metadata_props[:]
        for key, value in meta.items():
            proto.metadata_props.add(key=key, value=value)
        tmp.write_bytes(proto.SerializeToString())
        tmp.chmod(0o644)
        os.replace(tmp, dest)
    finally:
        root.disabled = was
        tmp.unlink(missing_ok=True)
    log.info("quantized the sentence encoder to int8 (%.0f MB) in %.1fs", dest.stat().st_size / 1e6,
             time.perf_counter() - t0)  # fmt: skip
