"""Second-stage verifier: MiniLM read as a cross-encoder, with a small LoRA adapter.

A bi-encoder compares two fixed vectors, so "learn Java" and "learn Python" end up close whatever the
head on top does. A cross-encoder reads both questions in one pass, and every token attends to the other
question. The base weights are the all-MiniLM-L6-v2 the gateway already ships for embeddings; only the
low-rank updates, the LayerNorms, the pooler and a small head are trained and shipped (2 MB), so nothing
new is downloaded and the stored FAISS vectors do not change.

The model and its training loop; ``embeddings/cross_onnx.py`` serves it, ``gateway/offline/train_verifier.py``
trains it from a CSV (``cachegw train-verifier --cross``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

ARTIFACT_PATH = Path(__file__).parent / "artifacts" / "cross_encoder.npz"
LORA_TARGETS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)
MAX_LEN = 96


@dataclass(frozen=True)
class CrossConfig:
    rank: int = 16
    alpha: float = 32.0
    epochs: float = 3.0  # what the shipped artifact was trained with
    batch_size: int = 32
    lr: float = 5e-4
    weight_decay: float = 0.01
    seed: int = 0
    identity_fraction: float = 0.1  # extra positives: a question against a re-typed copy of itself


def _torch() -> Any:
    import torch

    return torch


def _lora_linear_cls() -> Any:
    torch = _torch()
    nn = torch.nn

    class LoRALinear(nn.Module):
        """y = W x + (alpha / r) * B A x, with W frozen and B starting at zero (so training starts at W)."""

        def __init__(self, base: Any, rank: int, alpha: float) -> None:
            super().__init__()
            self.base = base
            self.scale = alpha / rank
            self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
            self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
            nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

        def forward(self, x: Any) -> Any:
            return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale

    return LoRALinear


def _build(model_path: str, rank: int, alpha: float) -> Any:
    """Base MiniLM with LoRA wrapped around every attention and feed-forward projection, plus a head."""
    torch = _torch()
    from transformers import AutoModel

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    bert = AutoModel.from_pretrained(model_path)  # keeps its pretrained pooler (dense + tanh on [CLS])
    lora = _lora_linear_cls()
    for p in bert.parameters():
        p.requires_grad_(False)
    for layer in bert.encoder.layer:
        for name in LORA_TARGETS:
            parent = layer
            *path, leaf = name.split(".")
            for part in path:
                parent = getattr(parent, part)
            setattr(parent, leaf, lora(getattr(parent, leaf), rank, alpha))
    for name, p in bert.named_parameters():
        if "LayerNorm" in name or name.startswith("pooler."):
            p.requires_grad_(True)

    class Pair(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert
            h = bert.config.hidden_size
            self.head = torch.nn.Linear(h, 1)

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return self.head(out.pooler_output).squeeze(-1)

    return Pair()


def _trainable(model: Any) -> dict[str, Any]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _batches(tok: Any, q1: Sequence[str], q2: Sequence[str], idx: np.ndarray, bs: int) -> list[tuple]:
    """Length-sorted batches (little padding), in the given order of chunks."""
    out = []
    for s in range(0, len(idx), bs * 50):
        chunk = idx[s : s + bs * 50]
        chunk = chunk[np.argsort([len(q1[i]) + len(q2[i]) for i in chunk], kind="stable")]
        for b in range(0, len(chunk), bs):
            ids = chunk[b : b + bs]
            enc = tok(
                [q1[i] for i in ids],
                [q2[i] for i in ids],
                truncation=True,
                max_length=MAX_LEN,
                padding=True,
                return_tensors="pt",
            )
            out.append((ids, enc))
    return out


def _load_state(model: Any, artifact: Path) -> None:
    """The artifact's trained tensors into a model ``_build`` made with the artifact's rank and alpha."""
    torch = _torch()
    with np.load(artifact, allow_pickle=False) as data:
        state = {k: torch.from_numpy(data[k].astype(np.float32)) for k in data.files if k != "meta"}
    missing = set(_trainable(model)) - set(state)
    if missing:
        raise ValueError(f"{artifact}: missing tensors {sorted(missing)[:3]}")
    model.load_state_dict(state, strict=False)


class CrossEncoder:
    """Scores pairs with the LoRA-adapted MiniLM cross-encoder (torch; loaded on first use)."""

    def __init__(self, artifact: Path | str = ARTIFACT_PATH, model_path: str | None = None) -> None:
        self.artifact = Path(artifact)
        self._model_path = model_path
        self._model: Any = None
        self._tok: Any = None

    def load(self) -> CrossEncoder:
        """Read the artifact and build the model (also done on first use); raises if it is unusable."""
        if self._model is not None:
            return self
        from cachegw.embeddings.encoder import default_model_path

        path = self._model_path or default_model_path()
        with np.load(self.artifact, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
        model = _build(path, meta["rank"], meta["alpha"])
        _load_state(model, self.artifact)
        model.eval()
        self._model, self._tok = model, _tokenizer(path)
        return self

    def score_batch(self, q1: Sequence[str], q2: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """P(duplicate) for each pair, in the order given (the model was trained on both orders)."""
        self.load()
        torch = _torch()
        out = np.zeros(len(q1), dtype=np.float32)
        with torch.inference_mode():
            for ids, enc in _batches(self._tok, q1, q2, np.arange(len(q1)), batch_size):
                out[ids] = torch.sigmoid(self._model(**enc)).numpy()
        return out


def retyped(text: str, rng: np.random.Generator) -> str:
    """The same question as another user types it: casing, spacing and end punctuation only.

    QQP never pairs a question with itself, and its few near-identical pairs are often labelled "not
    duplicate" (label noise). Without these, the model learned to doubt "Where is my order?" against
    "where is my order ??" (p = 0.25).
    """
    t = text.strip()
    choice = int(rng.integers(6))
    if choice == 0:
        t = t[:1].lower() + t[1:]
    elif choice == 1:
        t = t.lower()
    elif choice == 2:
        t = t.rstrip("?.! ") + rng.choice(["", " ?", "??", "?!", "."])
    elif choice == 3:
        t = " ".join(t.split()) + " "
    elif choice == 4:
        t = t[:1].upper() + t[1:].rstrip("?") + "?"
    return t


def _with_identities(
    q1: Sequence[str], q2: Sequence[str], y: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[list[str], list[str], np.ndarray]:
    texts = sorted(set(q1) | set(q2))
    n = min(len(texts), int(round(len(q1) * fraction)))
    picked = [texts[i] for i in rng.choice(len(texts), size=n, replace=False)] if n else []
    a = list(q1) + picked
    b = list(q2) + [retyped(t, rng) for t in picked]
    return a, b, np.concatenate([np.asarray(y, dtype=np.float32), np.ones(n, dtype=np.float32)])


def merged_model(ce: CrossEncoder) -> Any:
    """The torch model with each LoRA update folded into its base weight (plain Linear layers again)."""
    torch = _torch()
    model = ce.load()._model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if hasattr(child, "lora_a"):
                merged = torch.nn.Linear(child.base.in_features, child.base.out_features)
                with torch.no_grad():
                    merged.weight.copy_(child.base.weight + child.scale * (child.lora_b @ child.lora_a))
                    merged.bias.copy_(child.base.bias)
                setattr(module, name, merged)
    return model.eval()


def train_cross_encoder(
    q1: Sequence[str],
    q2: Sequence[str],
    y: np.ndarray,
    out: Path | str,
    cfg: CrossConfig = CrossConfig(),
    progress: Callable[[str], None] = print,
    model_path: str | None = None,
    init: Path | None = None,
) -> dict[str, Any]:
    """Fit the adapter on labelled pairs, each shown in both orders, and save the artifact atomically.
    ``init``: an artifact of the same rank to continue from (fine-tuning it on new pairs).

    ``cfg.epochs`` counts passes over the pairs (both orders of a pair make one pass each). About 0.6 s per
    step of 32 on a 2-core CPU: 16.7k QQP pairs (plus 10% re-typed copies) for 3 epochs take about 19 min.
    """
    torch = _torch()
    from cachegw.embeddings.encoder import default_model_path

    if len(q1) != len(q2) or len(q1) != len(y):
        raise ValueError("q1, q2 and y differ in length")
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    path = model_path or default_model_path()
    model, tok = _build(path, cfg.rank, cfg.alpha), _tokenizer(path)
    if init is not None:
        _load_state(model, Path(init))
    q1, q2, y = _with_identities(q1, q2, y, cfg.identity_fraction, rng)
    a, b = list(q1) + list(q2), list(q2) + list(q1)
    labels = torch.from_numpy(np.concatenate([y, y]).astype(np.float32))
    n = len(a)
    steps = max(1, int(math.ceil(n / cfg.batch_size) * cfg.epochs / 2))
    opt = torch.optim.AdamW(list(_trainable(model).values()), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * max(0.0, (steps - s) / max(1, steps - warm))
    )
    loss_fn = torch.nn.BCEWithLogitsLoss()
    step, t0, recent = 0, time.perf_counter(), []
    model.train()
    while step < steps:
        for ids, enc in _batches(tok, a, b, rng.permutation(n), cfg.batch_size):
            loss = loss_fn(model(**enc), labels[ids])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step, recent = step + 1, (recent + [loss.item()])[-50:]
            if step % 50 == 0 or step == steps:
                el = time.perf_counter() - t0
                progress(
                    f"cross-encoder step {step}/{steps}  loss {np.mean(recent):.3f}  "
                    f"{el:.0f}s elapsed, about {el / step * (steps - step):.0f}s left"
                )
            if step >= steps:
                break
    state = {
        k: v.detach().numpy().astype(np.float16 if "lora" in k else np.float32)
        for k, v in _trainable(model).items()
    }
    meta = {
        "format": 1,
        "rank": cfg.rank,
        "alpha": cfg.alpha,
        "epochs": cfg.epochs,
        "steps": steps,
        "pairs": len(q1),
        "identity_fraction": cfg.identity_fraction,
        "max_len": MAX_LEN,
        "seconds": round(time.perf_counter() - t0, 1),
        "lr": cfg.lr,
        "init": None if init is None else Path(init).name,
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez(tmp, meta=np.array(json.dumps(meta)), **state)
    tmp.replace(out)
    return meta
