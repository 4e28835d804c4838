"""The cross-encoder stage on ONNX Runtime, int8: about 2-3 ms per pair on one core instead of 12 on torch.

The shipped artifact holds only the LoRA updates, LayerNorms and head (``embeddings/cross_encoder.py``). On
first use they are merged into the base MiniLM weights, exported to ONNX and dynamically quantized to int8
(weights int8, activations quantized per call), into ``$CACHEGW_CACHE_DIR/verifier/<hash>/``; the hash
covers the artifact, the base weights and the library versions. The probability of three probe pairs under
torch is stored in the file's metadata and checked on every load: a file that disagrees by more than
``PROBE_TOLERANCE`` (corrupt, stale, a quantizer that went wrong) is exported again. Precision figures in
docs/verifier.md are measured with this int8 model, i.e. with what serves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cachegw.embeddings.cross_encoder import ARTIFACT_PATH, MAX_LEN, CrossEncoder, merged_model
from cachegw.embeddings.onnx_cache import (
    STALE_TEMP_S,
    cache_root,
    cpu_session,
    file_sha256,
    open_or_export,
    package_version,
)

log = logging.getLogger(__name__)

EXPORT_FORMAT = "2"
# Pairs far from p = 0.5, where int8 noise moves a probability least: a corrupt file moves them by far more.
PROBE_PAIRS = (
    ("How do I invest my money wisely?", "How can I invest my money wisely?"),
    ("How do I learn Java?", "How do I learn Python?"),
    ("What is the capital of France?", "How tall is the Eiffel Tower?"),
)
PROBE_TOLERANCE = 0.1  # per-channel int8 moves a probability by 0.02 on average (p99 0.11 near p = 0.5)
_META_PROBE = "cachegw.cross_probe"


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30.0, 30.0)))


class PairTokenizer:
    """[CLS] a [SEP] b [SEP] with token types, truncated longest-first to ``MAX_LEN`` (as in training)."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        pad = tok.padding or {}
        self.pad_id = int(pad.get("pad_id", 0))
        tok.no_padding()
        tok.enable_truncation(max_length=MAX_LEN, strategy="longest_first")
        self._tok = tok

    def batch(self, a: Sequence[str], b: Sequence[str]) -> dict[str, np.ndarray]:
        encs = self._tok.encode_batch(list(zip(a, b, strict=True)))
        width = max(len(e.ids) for e in encs)
        ids = np.full((len(encs), width), self.pad_id, dtype=np.int64)
        types = np.zeros_like(ids)
        mask = np.zeros_like(ids)
        for i, e in enumerate(encs):
            n = len(e.ids)
            ids[i, :n], types[i, :n], mask[i, :n] = e.ids, e.type_ids, 1
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


class CrossScorer:
    """P(duplicate) of (new, stored) query pairs from the int8 ONNX cross-encoder (lazy; ``load()`` early).

    ``threads`` is ORT's intra-op thread count (1: the gateway calls it from one worker thread).
    """

    def __init__(
        self,
        artifact: Path | str = ARTIFACT_PATH,
        model_path: str | None = None,
        threads: int = 1,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.artifact = Path(artifact)
        self._model_path = model_path
        self._threads = threads
        self._cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self._lock = threading.Lock()
        self._session: Any = None
        self._tok: PairTokenizer | None = None
        self.model_file: Path | None = None
        self.exported = False

    def load(self) -> CrossScorer:
        with self._lock:
            if self._session is None:
                self._load_locked()
        return self

    def _load_locked(self) -> None:
        from cachegw.embeddings.encoder import default_model_path

        if not self.artifact.is_file():
            raise FileNotFoundError(f"cross-encoder artifact {self.artifact} not found")
        model_dir = Path(self._model_path or default_model_path())
        self._tok = PairTokenizer(model_dir)
        path = self._cache_path(model_dir)
        t0 = time.perf_counter()
        tok = self._tok
        session, self.exported = open_or_export(
            path, self._open, lambda: _export(self.artifact, model_dir, path, tok)
        )
        self._session, self.model_file = session, path
        log.info("loaded int8 cross-encoder verifier %s in %.1fs", path, time.perf_counter() - t0)

    def _cache_path(self, model_dir: Path) -> Path:
        key = "|".join(
            [
                file_sha256(self.artifact),
                file_sha256(model_dir / "model.safetensors"),
                *(package_version(d) for d in ("torch", "transformers", "onnx", "onnxruntime")),
                EXPORT_FORMAT,
            ]
        )
        short = hashlib.sha256(key.encode()).hexdigest()[:12]
        return (self._cache_dir or cache_root()) / "verifier" / f"cross-{short}" / "model-int8.onnx"

    def _open(self, path: Path) -> Any:
        session = cpu_session(path, self._threads)
        probe = session.get_modelmeta().custom_metadata_map.get(_META_PROBE)
        if probe is None:
            raise ValueError("no probe probabilities in the model metadata")
        assert self._tok is not None
        got = _run(session, self._tok, *zip(*PROBE_PAIRS, strict=True))
        gap = float(np.max(np.abs(got - np.asarray(json.loads(probe)))))
        if not gap <= PROBE_TOLERANCE:
            raise ValueError(f"probe probabilities differ from torch's by {gap:.3f}")
        return session

    def score_batch(self, q_new: Sequence[str], q_old: Sequence[str]) -> np.ndarray:
        """Probability per pair; the pair is read as [CLS] new [SEP] stored [SEP]."""
        if len(q_new) != len(q_old):
            raise ValueError("q_new and q_old differ in length")
        if not q_new:
            return np.zeros(0, dtype=np.float32)
        if self._session is None:
            self.load()
        assert self._tok is not None
        return _run(self._session, self._tok, q_new, q_old)


def _run(session: Any, tok: PairTokenizer, a: Sequence[str], b: Sequence[str]) -> np.ndarray:
    """One ORT call per pair. Dynamic quantization scales activations per call, so a pair scored in a
    batch would get a (slightly) different probability than alone; the gateway scores one candidate at a
    time, and so does every benchmark, so the figures are the served ones."""
    out = np.zeros(len(a), dtype=np.float32)
    for i in range(len(a)):
        out[i] = _sigmoid(session.run(None, tok.batch([a[i]], [b[i]]))[0].reshape(-1))[0]
    return out


def _export(artifact: Path, model_dir: Path, dest: Path, tok: PairTokenizer) -> None:
    """Merge, export, quantize to int8, stamp the torch probe probabilities, and move into place."""
    import onnx
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    t0 = time.perf_counter()
    log.info("exporting the cross-encoder verifier to int8 ONNX (one time, ~20 s) -> %s", dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(".export-*"):  # left by a process killed mid-export
        if time.time() - stale.stat().st_mtime > STALE_TEMP_S:
            shutil.rmtree(stale, ignore_errors=True)
    model = merged_model(CrossEncoder(artifact, str(model_dir)))
    a, b = zip(*PROBE_PAIRS, strict=True)
    feeds = tok.batch(a, b)
    tensors = {k: torch.from_numpy(v) for k, v in feeds.items()}
    with torch.no_grad():
        want = _sigmoid(model(**tensors).numpy())
    tmpdir = Path(tempfile.mkdtemp(prefix=".export-", dir=dest.parent))
    try:
        fp32, int8 = tmpdir / "fp32.onnx", tmpdir / "int8.onnx"
        names = ["input_ids", "attention_mask", "token_type_ids"]
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model,
                tuple(tensors[k] for k in names),
                str(fp32),
                input_names=names,
                output_names=["logit"],
                dynamic_axes={**{k: {0: "batch", 1: "sequence"} for k in names}, "logit": {0: "batch"}},
                opset_version=17,
                dynamo=False,
            )
        root = logging.getLogger()
        was = root.disabled
        root.disabled = True  # the quantizer logs a "consider pre-processing" warning on the root logger
        try:
            # per channel: half the error of per-tensor scales (mean |dp| 0.020 vs 0.039), same speed
            quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8, per_channel=True)
        finally:
            root.disabled = was
        proto = onnx.load(str(int8))
        entry = proto.metadata_props.add()
        entry.key, entry.value = _META_PROBE, json.dumps([round(float(p), 6) for p in want])
        onnx.save(proto, str(int8))
        tmp_final = tmpdir / "final.onnx"
        int8.replace(tmp_final)
        os.replace(tmp_final, dest)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    log.info("cross-encoder exported in %.1fs (%.1f MB)", time.perf_counter() - t0, dest.stat().st_size / 1e6)
