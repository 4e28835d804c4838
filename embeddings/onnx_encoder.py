"""The MiniLM sentence encoder on ONNX Runtime: same vectors as ``Encoder``, a fraction of the latency.

A semantic-cache hit costs one query embedding. sentence-transformers on torch spends 12-14 ms on one short
query on a 2-core box (mostly framework overhead on a 6-layer, 384-wide BERT); ONNX Runtime runs the same
graph in a few ms. Everything around the transformer is replicated exactly in numpy so the vectors match the
torch ones (cosine >= 0.9999) and the verifier trained on them needs no re-validation:

* tokenizer: the model folder's ``tokenizer.json`` through the ``tokenizers`` backend directly (no
  transformers wrapper per call), truncated to ``max_seq_length`` from ``sentence_bert_config.json`` (256;
  the file's own default of 128 would silently differ); padding is excluded from the pooling, so texts
  are batched by length to pad little;
* mean pooling over the attention mask, then L2 normalization.

The transformer is exported once, on first use, with torch's TorchScript exporter (needs ``onnx``, not
onnxscript) into ``$CACHEGW_CACHE_DIR/embeddings/<model>-<hash>/model.onnx`` where the hash covers the
weights file and the torch/transformers/onnx/onnxruntime versions. ORT fuses the graph at load (level ALL,
for the CPU it runs on); ORT's offline BERT fusion (``optimize=True``) is exact too but measured no better
on a 2-core EPYC: about 4% faster for one short query, 5-20% slower for batches (bench/encoder_latency.py).
The file is written atomically and carries the torch embedding of two probe texts in its metadata: every
load re-embeds them, and a file that fails to load or disagrees (corrupt, truncated, wrong) is exported
again instead of serving bad vectors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from cachegw.embeddings.onnx_cache import (
    cache_root,
    cpu_session,
    file_sha256,
    open_or_export,
    package_version,
)

log = logging.getLogger(__name__)

# Bump when the exported graph changes meaning (inputs, outputs, fusion): old cache folders are then ignored.
EXPORT_FORMAT = "1"
PROBE_TEXTS = ["cachegw onnx probe: how do I reset my password?", "short"]
PROBE_MIN_COSINE = 0.99999  # what an export, and a later load of it, must reach against torch
# int8 weights move a vector by a cosine of about 0.005 (median on QQP questions; 0.014 at worst in 1,500)
INT8_PROBE_MIN_COSINE = 0.98
META_PROBE = "cachegw.probe"
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
CALL_COST_TOKENS = 24  # fixed cost of one ORT call in padded-token equivalents (see _plan_batches)


def _model_name(model_dir: Path) -> str:
    """A readable folder name: the packaged model's folder is just ``model``, so name it after its package."""
    name = model_dir.name
    if name == "model" and model_dir.parent.name:
        name = model_dir.parent.name
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "model"


class OnnxEncoder:
    """Drop-in for ``embeddings.encoder.Encoder`` (``dim``, ``encode``) running MiniLM on ONNX Runtime.

    ``threads`` is ORT's intra-op thread count: 1 by default because the gateway embeds on one worker thread
    of a small box and extra threads only spin against the event loop. Loading (and exporting the first time)
    is lazy, on first ``encode`` or an explicit ``load()``.

    ``int8``: the same graph with int8 weights (per output channel, ``onnx_export.quantize_int8``), 2.4x
    less time per query. Its activations are quantized per call, so a text's vector would depend on the
    texts padded beside it: each text then runs alone, and its vector is the same in any batch.
    """

    def __init__(
        self,
        model_path: str | None = None,
        threads: int = 1,
        batch_size: int = 64,
        cache_dir: str | os.PathLike[str] | None = None,
        optimize: bool = False,
        int8: bool = False,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._model_path = model_path
        self._threads = threads
        self._batch_size = batch_size
        self._cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self._optimize = optimize
        self.int8 = int8
        self._lock = threading.Lock()
        self._session: Any = None
        self._tokenizer: Any = None  # Tokenizer once loaded
        self._output: str = "last_hidden_state"
        self._dim = 384
        self.model_file: Path | None = None  # the cached model.onnx in use, once loaded
        self.exported = False  # whether this instance had to export (tests and logs)

    @property
    def dim(self) -> int:
        """Embedding width (384 for MiniLM-L6); known without loading the model."""
        return self._dim

    # ---- loading -------------------------------------------------------------------------------------

    def load(self) -> OnnxEncoder:
        """Export if needed and open the ORT session; raises when that cannot work (``auto`` falls back)."""
        with self._lock:
            if self._session is None:
                self._load_locked()
        return self

    def _load_locked(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import onnxruntime  # noqa: F401  (fail fast, before any export work)

        from cachegw.embeddings.encoder import default_model_path

        model_dir = Path(self._model_path or default_model_path())
        st_cfg = _read_json(model_dir / "sentence_bert_config.json")
        max_len = int(st_cfg.get("max_seq_length") or 512)
        if st_cfg.get("do_lower_case"):
            raise ValueError(f"{model_dir}: do_lower_case models are not replicated by the ONNX encoder")
        self._dim = _check_pipeline(model_dir)
        self._tokenizer = Tokenizer(model_dir / "tokenizer.json", max_len)

        path = self._cache_path(model_dir)
        t0 = time.perf_counter()
        tokenizer = self._tokenizer
        from cachegw.embeddings.onnx_export import (
            export_transformer,  # torch and onnx: only when exporting
            quantize_int8,
        )

        def export() -> None:
            if not self.int8:
                export_transformer(model_dir, path, tokenizer, optimize=self._optimize)
                return
            fp32 = self._cache_path(model_dir, int8=False)
            if not fp32.exists():
                export_transformer(model_dir, fp32, tokenizer, optimize=self._optimize)
            quantize_int8(fp32, path)

        session, self.exported = open_or_export(path, self._open, export)
        self._session = session
        self.model_file = path
        log.info(
            "loaded ONNX sentence encoder %s (%d thread%s) in %.1fs",
            path,
            self._threads,
            "" if self._threads == 1 else "s",
            time.perf_counter() - t0,
        )

    def _cache_path(self, model_dir: Path, int8: bool | None = None) -> Path:
        int8 = self.int8 if int8 is None else int8
        weights = next((model_dir / f for f in _WEIGHT_FILES if (model_dir / f).exists()), None)
        if weights is None:
            raise FileNotFoundError(f"no weights ({' or '.join(_WEIGHT_FILES)}) in {model_dir}")
        key = "|".join(
            [
                file_sha256(weights),
                package_version("torch"),
                package_version("transformers"),
                package_version("onnx"),
                package_version("onnxruntime"),
                EXPORT_FORMAT,
                "fused" if self._optimize else "plain",
            ]
        )
        short = hashlib.sha256(key.encode()).hexdigest()[:12]
        root = self._cache_dir or cache_root()
        folder = root / "embeddings" / f"{_model_name(model_dir)}-{short}"
        return folder / ("model-int8.onnx" if int8 else "model.onnx")  # int8: from the float32 file beside it

    def _open(self, path: Path) -> Any:
        """An ORT session on ``path`` that reproduces the probe embeddings stored in the file at export."""
        session = cpu_session(path, self._threads)
        self._output = session.get_outputs()[0].name
        probe = session.get_modelmeta().custom_metadata_map.get(META_PROBE)
        if probe is None:
            raise ValueError("no probe embedding in the model metadata")
        want = np.asarray(json.loads(probe), dtype=np.float32)
        got = self._embed(session, PROBE_TEXTS)
        if got.shape != want.shape:
            raise ValueError(f"probe embeddings have shape {got.shape}, expected {want.shape}")
        cos = float((got * want).sum(axis=1).min())
        if not cos >= (INT8_PROBE_MIN_COSINE if self.int8 else PROBE_MIN_COSINE):
            raise ValueError(f"probe embeddings differ from torch's (cosine {cos:.6f})")
        return session

    # ---- encoding ------------------------------------------------------------------------------------

    def _run(self, session: Any, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One ORT call on a padded batch, pooled and normalized in numpy."""
        hidden = session.run([self._output], {"input_ids": ids, "attention_mask": mask})[0]
        return mean_pool_normalize(hidden, mask)

    def _embed(self, session: Any, texts: list[str]) -> np.ndarray:
        if self.int8:
            return np.concatenate([self._run(session, *self._tokenizer.batch([t])) for t in texts])
        return self._run(session, *self._tokenizer.batch(texts))

    def encode(self, texts: list[str], show_progress: bool = False) -> np.ndarray:
        """Embed ``texts`` into a [n, dim] float32 array with unit-norm rows (same as ``Encoder.encode``).

        Several texts are sorted by token count and cut into runs that pad little (``_plan_batches``): a
        micro-batch of 64 short queries with one long one would otherwise pay 64 times the long one. A
        text's vector does not depend on its batch (checked in the tests), so this changes only the time.
        """
        texts = [str(t) for t in texts]
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        if self._session is None:
            self.load()
        rows = self._tokenizer.ids(texts)
        if len(rows) == 1 or self.int8:  # int8: each text alone (its vector must not depend on its batch)
            return np.concatenate([self._run(self._session, *self._tokenizer.pad([r])) for r in rows])
        lengths = np.array([len(r) for r in rows])
        order = np.argsort(lengths, kind="stable")
        runs: Any = _plan_batches(lengths[order].tolist(), self._batch_size)
        if show_progress:
            from tqdm import tqdm

            runs = tqdm(runs, desc="embedding", unit="batch")
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for start, end in runs:
            idx = order[start:end]
            out[idx] = self._run(self._session, *self._tokenizer.pad([rows[i] for i in idx]))
        return out


# ---- pipeline checks and tokenizer --------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _check_pipeline(model_dir: Path) -> int:
    """The width, after checking the folder is Transformer, mean Pooling, Normalize (what is replicated)."""
    modules = json.loads((model_dir / "modules.json").read_text())
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    if kinds != ["Transformer", "Pooling", "Normalize"]:
        raise ValueError(f"{model_dir}: pipeline {kinds} is not Transformer, Pooling, Normalize")
    pooling = _read_json(model_dir / modules[1]["path"] / "config.json")
    modes = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v]
    if modes != ["pooling_mode_mean_tokens"]:
        raise ValueError(f"{model_dir}: pooling {modes} is not mean pooling")
    return int(pooling["word_embedding_dimension"])


def _plan_batches(
    lengths: list[int], max_batch: int, call_cost: int = CALL_COST_TOKENS
) -> list[tuple[int, int]]:
    """Cut ascending token ``lengths`` into ``[start, end)`` runs of at most ``max_batch`` rows.

    Minimizes the padded tokens computed (a run pads to its last, longest row) plus a fixed ``call_cost``
    per run (an ORT call streams all weights once: about 24 tokens' worth at batch 1 on a 2-core EPYC), by
    dynamic programming over the cut points: O(n * max_batch), well under a millisecond for 64 texts.
    """
    n = len(lengths)
    best = [0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        width = lengths[j - 1]
        for i in range(max(0, j - max_batch), j):
            cost = best[i] + call_cost + (j - i) * width
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs = []
    while n > 0:
        runs.append((cut[n], n))
        n = cut[n]
    return runs[::-1]


# ---- export ---------------------------------------------------------------------------------------------


def mean_pool_normalize(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """sentence-transformers' mean pooling (padding excluded, count clamped at 1e-9) then L2 normalization."""
    m = mask.astype(np.float32)
    summed = np.einsum("bsd,bs->bd", hidden, m)
    vecs = summed / np.maximum(m.sum(axis=1, keepdims=True), 1e-9)
    norms = np.linalg.norm(vecs, axis=1, keepdims=True)
    return (vecs / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)


class Tokenizer:
    """The folder's fast tokenizer, truncating like sentence-transformers (checked in the tests).

    Padding is done here in numpy rather than by the tokenizer, so that ``encode`` can pad each run of
    similar lengths on its own.
    """

    def __init__(self, path: Path, max_len: int) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        pad = tok.padding or {}
        pad_id = tok.token_to_id(pad.get("pad_token", "[PAD]"))
        self.pad_id = int(pad.get("pad_id", 0) if pad_id is None else pad_id)
        tok.no_padding()
        tok.enable_truncation(max_length=max_len, strategy="longest_first")
        self._tok = tok

    def ids(self, texts: list[str]) -> list[list[int]]:
        if len(texts) == 1:  # encode_batch's overhead is not worth it for the common single query
            return [self._tok.encode(texts[0]).ids]
        return [e.ids for e in self._tok.encode_batch(texts)]

    def pad(self, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """input_ids and attention_mask, right-padded to the longest row."""
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
            mask[i, : len(r)] = 1
        return ids, mask

    def batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return self.pad(self.ids(texts))
