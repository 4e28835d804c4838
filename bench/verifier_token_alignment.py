"""Experiment: do BERTScore-style token-alignment features lift the verifier's precision on QQP?

Usage (from the project root, one CPU thread so it can share the box):
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python -m bench.verifier_token_alignment [--no-pca]

Report-only: the shipped verifier is not touched. The pooled vector of all-MiniLM-L6-v2 hides the one word
that changes a question ("phone under 15000" vs "under 20000", a swapped entity). This script takes the
contextual token embeddings (ONNX encoder's ``last_hidden_state`` before pooling, [CLS]/[SEP] dropped) and
adds alignment features to the verifier's own ``pair_features``: greedy-match precision/recall/F1 (plain
and IDF-weighted), the weakest best match among content tokens on each side, counts of tokens whose best
match is below 0.5/0.6/0.7, monotone order of the matches and mutual-nearest-neighbour rate.

Protocol, identical for every model variant in one run:
* QQP split of ``bench.verifier_quality.split_qqp`` (30% test by sha1 of id, train decontaminated);
* training as in ``policies.verifier_training.train_verifier``: guard-vetoed pairs dropped, identity pairs
  added,
  hashed 15% validation for early stopping, 3-seed ensemble of the 64-unit MLP (``_fit_ensemble``);
* the operating point (``min_prob`` at the shipped cosine floor 0.88) is chosen on that validation part,
  counting every validation positive (guard-vetoed ones too, as the test recall does): the highest
  validation precision with validation recall >= 0.30. Test is only read to report.
* "oracle": the best test precision at test recall >= 0.30 over all ``min_prob`` cuts (not a claim).

Token embeddings are cached in float16 under ``$TMPDIR/cachegw-token-align`` (about 1 GB for QQP).
Writes bench/results/verifier_token_alignment.json and prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import RESULTS as RESULTS_DIR  # noqa: E402
from bench.common import machine  # noqa: E402
from bench.verifier_eval import PairSet, auc, operating_points, qqp_pair_sets, subset  # noqa: E402
from cachegw.embeddings.onnx_encoder import OnnxEncoder, _plan_batches  # noqa: E402
from cachegw.policies.query_parse import STOPWORDS  # noqa: E402
from cachegw.policies.verifier import DEFAULT_RULE, Verifier  # noqa: E402
from cachegw.policies.verifier_features import LEXICAL_NAMES, pair_features  # noqa: E402
from cachegw.policies.verifier_training import _fit_ensemble, _val_mask  # noqa: E402

CACHE_DIR = Path(tempfile.gettempdir()) / "cachegw-token-align"
LOW_MATCH = (0.5, 0.6, 0.7)
ALIGN_NAMES = (
    "tok_f1",
    "tok_pr_min",
    "tok_pr_max",
    "tok_f1_idf",
    "tok_pr_min_idf",
    "content_min_match_lo",
    "content_min_match_hi",
    *(f"content_below_{t}" for t in LOW_MATCH),
    "content_below_0.6_both_sides",
    "order_monotone",
    "mutual_nn",
    "unmatched_mass_idf",
)


# ---------------------------------------------------------------------------------------- token embeddings


@dataclass
class TokenStore:
    """Per text: its token rows (fp16, no [CLS]/[SEP]/padding), pooled vector, content mask, token ids."""

    texts: list[str]
    offsets: np.ndarray  # [n+1] into rows
    rows: np.ndarray  # [total, 384] float16, raw last_hidden_state
    pooled: np.ndarray  # [n, 384] float32, mean pooled over [CLS]..[SEP] and L2-normalized (= the encoder)
    ids: np.ndarray  # [total] int32 wordpiece ids
    content: np.ndarray  # [total] bool: piece of a word that is not a stopword / punctuation

    def __post_init__(self) -> None:
        self.index = {t: i for i, t in enumerate(self.texts)}

    def span(self, text: str) -> slice:
        i = self.index[text]
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))


def _content_mask(tokens: list[str]) -> list[bool]:
    """Content flag per wordpiece: a "##" piece inherits its word's flag."""
    out, cur = [], False
    for tok in tokens:
        if tok.startswith("##"):
            out.append(cur)
            continue
        cur = any(c.isalnum() for c in tok) and tok not in STOPWORDS
        out.append(cur)
    return out


def embed_tokens(texts: list[str], batch_size: int = 64) -> TokenStore:
    """Run the exported MiniLM once per text (single thread), keeping the token states; cached in /tmp."""
    key = hashlib.sha1("\x00".join(texts).encode()).hexdigest()[:16]
    path = CACHE_DIR / f"tokens-{key}.npz"
    if path.exists():
        with np.load(path) as z:
            print(f"  token embeddings from cache {path}", flush=True)
            return TokenStore(texts, z["offsets"], z["rows"], z["pooled"], z["ids"], z["content"])
    enc = OnnxEncoder(threads=1).load()
    tok = enc._tokenizer
    encs = tok._tok.encode_batch(texts)
    lengths = np.array([len(e.ids) for e in encs])
    order = np.argsort(lengths, kind="stable")
    n_inner = np.maximum(lengths - 2, 0)
    offsets = np.concatenate([[0], np.cumsum(n_inner)])
    rows = np.zeros((int(offsets[-1]), enc.dim), dtype=np.float16)
    pooled = np.zeros((len(texts), enc.dim), dtype=np.float32)
    ids = np.zeros(int(offsets[-1]), dtype=np.int32)
    content = np.zeros(int(offsets[-1]), dtype=bool)
    for i, e in enumerate(encs):
        ids[offsets[i] : offsets[i + 1]] = e.ids[1:-1]
        content[offsets[i] : offsets[i + 1]] = _content_mask(e.tokens[1:-1])
    runs = _plan_batches(lengths[order].tolist(), batch_size)
    t0, done = time.perf_counter(), 0
    for k, (start, end) in enumerate(runs):
        idx = order[start:end]
        ids_b, mask_b = tok.pad([encs[i].ids for i in idx])
        hidden = enc._session.run([enc._output], {"input_ids": ids_b, "attention_mask": mask_b})[0]
        m = mask_b.astype(np.float32)
        vec = np.einsum("bsd,bs->bd", hidden, m) / np.maximum(m.sum(1, keepdims=True), 1e-9)
        pooled[idx] = vec / np.maximum(np.linalg.norm(vec, axis=1, keepdims=True), 1e-12)
        for r, i in enumerate(idx):
            rows[offsets[i] : offsets[i + 1]] = hidden[r, 1 : lengths[i] - 1]
        done += len(idx)
        if k % 200 == 0 or end == len(texts):
            rate = done / max(time.perf_counter() - t0, 1e-9)
            print(f"  embedded {done:,}/{len(texts):,} texts ({rate:.0f}/s)", flush=True)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, offsets=offsets, rows=rows, pooled=pooled, ids=ids, content=content)
    os.replace(tmp, path)
    return TokenStore(texts, offsets, rows, pooled, ids, content)


def normalized_rows(rows: np.ndarray, proj: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Unit-norm token rows (optionally centered and projected by a PCA), in chunks to bound memory."""
    width = rows.shape[1] if proj is None else proj[1].shape[1]
    out = np.empty((len(rows), width), dtype=np.float16)
    for s in range(0, len(rows), 200_000):
        x = rows[s : s + 200_000].astype(np.float32)
        if proj is not None:
            x = (x - proj[0]) @ proj[1]
        out[s : s + 200_000] = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    return out


def fit_pca(
    rows: np.ndarray, dim: int, seed: int = 0, sample: int = 200_000
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rows[rng.choice(len(rows), size=min(sample, len(rows)), replace=False)].astype(np.float32)
    mean = x.mean(0)
    _, s, vt = np.linalg.svd(x - mean, full_matrices=False)
    kept = float((s[:dim] ** 2).sum() / (s**2).sum())
    print(f"  PCA-{dim} keeps {kept:.1%} of the token variance", flush=True)
    return mean, vt[:dim].T.copy()


# ------------------------------------------------------------------------------------- alignment features


def _order_monotone(best: np.ndarray) -> float:
    """Fraction of concordant pairs among the best-match positions (ties ignored); 1.0 if < 2 pairs."""
    if len(best) < 2:
        return 1.0
    d = np.sign(best[None, :] - best[:, None])[np.triu_indices(len(best), 1)]
    n = int((d != 0).sum())
    return float((d > 0).sum() / n) if n else 1.0


def alignment_features(
    a: np.ndarray, b: np.ndarray, ca: np.ndarray, cb: np.ndarray, wa: np.ndarray, wb: np.ndarray
) -> list[float]:
    """Symmetric alignment features of two unit-norm token matrices, in the order of ``ALIGN_NAMES``.

    ``ca``/``cb`` mark content tokens (all tokens count where a side has none), ``wa``/``wb`` are IDF weights.
    """
    if len(a) == 0 or len(b) == 0:
        same = float(len(a) == len(b))
        return [same] * 7 + [0.0] * (len(LOW_MATCH) + 1) + [1.0, same, 1.0 - same]
    sim = a.astype(np.float32) @ b.astype(np.float32).T
    ja, jb = sim.argmax(1), sim.argmax(0)
    ra, rb = sim[np.arange(len(a)), ja], sim[jb, np.arange(len(b))]
    p, r = float(ra.mean()), float(rb.mean())
    pw, rw = float(ra @ wa / wa.sum()), float(rb @ wb / wb.sum())
    ca = ca if ca.any() else np.ones(len(a), dtype=bool)
    cb = cb if cb.any() else np.ones(len(b), dtype=bool)
    mins = sorted((float(ra[ca].min()), float(rb[cb].min())))
    below = [float(np.log1p((ra[ca] < t).sum() + (rb[cb] < t).sum())) for t in LOW_MATCH]
    both = float(min((ra[ca] < 0.6).sum(), (rb[cb] < 0.6).sum()) > 0)
    order = 0.5 * (_order_monotone(ja[ca]) + _order_monotone(jb[cb]))
    mutual = float((jb[ja] == np.arange(len(a))).sum() + (ja[jb] == np.arange(len(b))).sum())
    mutual /= len(a) + len(b)
    unmatched = float((wa @ (1 - ra) + wb @ (1 - rb)) / (wa.sum() + wb.sum()))
    return [
        2 * p * r / max(p + r, 1e-9),
        min(p, r),
        max(p, r),
        2 * pw * rw / max(pw + rw, 1e-9),
        min(pw, rw),
        *mins,
        *below,
        both,
        order,
        mutual,
        unmatched,
    ]


class Aligner:
    """Alignment features for text pairs from a TokenStore (normalized rows, IDF from training texts)."""

    def __init__(self, store: TokenStore, unit_rows: np.ndarray, idf: np.ndarray) -> None:
        self.store, self.unit, self.idf = store, unit_rows, idf

    def pair(self, qa: str, qb: str) -> list[float]:
        sa, sb = self.store.span(qa), self.store.span(qb)
        st = self.store
        return alignment_features(
            self.unit[sa],
            self.unit[sb],
            st.content[sa],
            st.content[sb],
            self.idf[st.ids[sa]],
            self.idf[st.ids[sb]],
        )

    def matrix(self, qa: list[str], qb: list[str]) -> np.ndarray:
        return np.array([self.pair(a, b) for a, b in zip(qa, qb, strict=True)], dtype=np.float32)


def idf_table(store: TokenStore, texts: list[str], vocab: int = 32_000) -> np.ndarray:
    """Smoothed IDF per wordpiece id over ``texts`` (the training questions only)."""
    df = np.zeros(vocab, dtype=np.float64)
    for t in texts:
        df[np.unique(store.ids[store.span(t)])] += 1
    return np.log((len(texts) + 1) / (df + 1)).astype(np.float32)


# ---------------------------------------------------------------------------------- training and scoring


def features(store: TokenStore, aligner: Aligner | None, q1: list[str], q2: list[str]) -> np.ndarray:
    """The shipped ``pair_features`` (on the pooled vectors), plus alignment features when ``aligner``."""
    u = store.pooled[[store.index[t] for t in q1]]
    v = store.pooled[[store.index[t] for t in q2]]
    x = pair_features(q1, q2, u, v)
    return x if aligner is None else np.hstack([x, aligner.matrix(q1, q2)])


def train(
    store: TokenStore, aligner: Aligner | None, tr: PairSet, *, hidden: int, members: int, seed: int
) -> tuple[Verifier, np.ndarray]:
    """A faithful copy of ``train_verifier`` on precomputed features; returns the model and its val mask."""
    keep = np.flatnonzero(~tr.vetoed)
    q1, q2 = [tr.q1[i] for i in keep], [tr.q2[i] for i in keep]
    rng = np.random.default_rng(seed)
    texts = sorted(set(q1) | set(q2))
    n_ident = min(len(texts), max(len(tr.y) // 20, 2))
    ident = [texts[i] for i in rng.choice(len(texts), size=n_ident, replace=False)]
    a, b = q1 + ident, q2 + ident
    y = np.concatenate([tr.y[keep], np.ones(len(ident), dtype=bool)]).astype(np.float32)
    x = features(store, aligner, a, b)
    val = _val_mask(a, b, 0.15)
    val[len(q1) :] = False
    params = _fit_ensemble(x, y, val, hidden, 40, seed, members)
    return Verifier(params, {}), _val_mask(tr.q1, tr.q2, 0.15)


def score(ver: Verifier, store: TokenStore, aligner: Aligner | None, ps: PairSet) -> tuple[np.ndarray, ...]:
    """(cosine, prob) per pair; prob is 0 where a guard fires, as in ``Verifier.score_batch``."""
    u = store.pooled[[store.index[t] for t in ps.q1]]
    v = store.pooled[[store.index[t] for t in ps.q2]]
    cos = np.einsum("ij,ij->i", u, v)
    prob = np.zeros(len(ps.y), dtype=np.float32)
    keep = np.flatnonzero(~ps.vetoed)
    prob[keep] = ver._mlp(features(store, aligner, [ps.q1[i] for i in keep], [ps.q2[i] for i in keep]))
    return cos, prob


def feature_auc(store: TokenStore, aligner: Aligner, tr: PairSet) -> dict[str, float]:
    """Univariate AUC (max of both directions) of each feature on the training pairs that reach the MLP
    at the shipped cosine floor: the region where the hard negatives live."""
    idx = np.flatnonzero(~tr.vetoed)
    q1, q2 = [tr.q1[i] for i in idx], [tr.q2[i] for i in idx]
    x = features(store, aligner, q1, q2)
    gate = x[:, 0] >= DEFAULT_RULE.min_cosine
    y = tr.y[idx][gate]
    names = [*LEXICAL_NAMES[:8], *ALIGN_NAMES]
    cols = [*range(8), *range(x.shape[1] - len(ALIGN_NAMES), x.shape[1])]
    out = {}
    for n, c in zip(names, cols, strict=True):
        a = auc(y, x[gate, c])
        out[n] = round(max(a, 1 - a), 4)
    return out


def evaluate(
    name: str, store: TokenStore, aligner: Aligner | None, tr: PairSet, te: PairSet, args: argparse.Namespace
) -> dict[str, Any]:
    t0 = time.perf_counter()
    runs = []
    for rep in range(args.repeats):
        seed = args.seed + 100 * rep
        print(f"[train] {name} (seed {seed})", flush=True)
        ver, val = train(store, aligner, tr, hidden=args.hidden, members=args.members, seed=seed)
        va = subset(tr, val)
        vcos, vprob = score(ver, store, aligner, va)
        tcos, tprob = score(ver, store, aligner, te)
        passed, gated = ~te.vetoed, tcos >= DEFAULT_RULE.min_cosine
        runs.append(
            {
                "seed": seed,
                **operating_points(va, vcos, vprob, te, tcos, tprob),
                "test_auc_unvetoed_cos_ge_floor": round(auc(te.y[passed & gated], tprob[passed & gated]), 4),
            }
        )
        print(f"  {json.dumps(runs[-1])}", flush=True)
    return {"name": name, "runs": runs, "seconds": round(time.perf_counter() - t0, 1)}


# ----------------------------------------------------------------------------------------- serving cost


def serving_cost(store: TokenStore, aligner: Aligner, te: PairSet, dims: dict[str, int]) -> dict[str, Any]:
    """Per-pair feature time (one pair per call, numpy) and bytes per cache entry for the token matrix."""
    n = min(1000, len(te.y))
    mats = [(aligner.pair(te.q1[i], te.q2[i]), i) for i in range(n)]  # warm
    times = []
    st = store
    for _, i in mats:
        sa, sb = st.span(te.q1[i]), st.span(te.q2[i])
        a, b = aligner.unit[sa], aligner.unit[sb]
        ca, cb, wa, wb = st.content[sa], st.content[sb], aligner.idf[st.ids[sa]], aligner.idf[st.ids[sb]]
        t0 = time.perf_counter()
        alignment_features(a, b, ca, cb, wa, wb)
        times.append(time.perf_counter() - t0)
    counts = np.diff(store.offsets)
    med = float(np.median(counts))
    out: dict[str, Any] = {
        "align_features_per_pair_us_median": round(float(np.median(times)) * 1e6, 1),
        "align_features_per_pair_us_p99": round(float(np.percentile(times, 99)) * 1e6, 1),
        "tokens_per_text_median_without_cls_sep": med,
        "tokens_per_text_p99": float(np.percentile(counts, 99)),
        "pooled_vector_bytes_fp32": 384 * 4,
    }
    for label, d in dims.items():
        out[f"bytes_per_entry_{label}_fp16_at_median"] = int(med * d * 2)
        out[f"bytes_per_entry_{label}_fp16_mean"] = round(float(counts.mean()) * d * 2, 1)
    return out


# ---------------------------------------------------------------------------------------------- main


def _cell(r: dict[str, Any], key: str) -> str:
    vals = [(run[key]["precision"], run[key]["recall"]) for run in r["runs"]]
    p, rc = np.mean([v[0] for v in vals]), np.mean([v[1] for v in vals])
    spread = f"±{np.std([v[0] for v in vals]):.3f}" if len(vals) > 1 else ""
    return f"{p:.3f}{spread} / {rc:.3f}"


def print_table(results: list[dict[str, Any]]) -> None:
    cols = ("test_default_rule", "test_at_val_chosen", "test_oracle_recall_ge_0.3")
    heads = ("default 0.88/0.80", "val-chosen point", "ORACLE best @R>=.3")
    print(
        f"\n{'model (test P / R; mean over seeds)':<36}" + "".join(f"{h:>25}" for h in heads) + f"{'AUC':>8}"
    )
    for r in results:
        a = np.mean([run["test_auc_unvetoed"] for run in r["runs"]])
        print(f"{r['name']:<36}" + "".join(f"{_cell(r, c):>25}" for c in cols) + f"{a:>8.4f}")
    print("val-chosen min_prob: " + "; ".join(
        f"{r['name']}: {[run['val_chosen_min_prob'] for run in r['runs']]}" for r in results))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1, help="seed repeats per model (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--no-pca", action="store_true", help="skip the PCA-64 variant")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    print("[1/5] splitting qqp_dev.csv", flush=True)
    tr, te, split_info = qqp_pair_sets()
    print(f"  {json.dumps(split_info)}", flush=True)
    texts = sorted(set(tr.q1) | set(tr.q2) | set(te.q1) | set(te.q2))
    print(f"[2/5] token embeddings of {len(texts):,} distinct questions (1 thread)", flush=True)
    store = embed_tokens(texts)
    train_texts = sorted(set(tr.q1) | set(tr.q2))
    idf = idf_table(store, train_texts)
    aligner = Aligner(store, normalized_rows(store.rows), idf)
    print("[3/5] baseline vs +alignment", flush=True)
    results = [
        evaluate("baseline (shipped features)", store, None, tr, te, args),
        evaluate("+ token alignment (384-d)", store, aligner, tr, te, args),
    ]
    dims = {"384d": 384}
    if not args.no_pca:
        print("[4/5] PCA-64 token projection fit on training-question tokens", flush=True)
        in_train = np.zeros(len(store.rows), dtype=bool)
        for t in train_texts:
            in_train[store.span(t)] = True
        proj = fit_pca(store.rows[in_train], 64, seed=args.seed)
        pca_aligner = Aligner(store, normalized_rows(store.rows, proj), idf)
        results.append(evaluate("+ token alignment (PCA-64)", store, pca_aligner, tr, te, args))
        dims["pca64"] = 64
    print("[5/5] serving cost and univariate feature AUCs (train pairs, cosine >= floor)", flush=True)
    cost = serving_cost(store, aligner, te, dims)
    uni = feature_auc(store, aligner, tr)
    out = {
        "machine": machine(),
        "split": split_info,
        "protocol": {
            "cosine_floor": DEFAULT_RULE.min_cosine,
            "operating_point": "min_prob with the best validation precision at validation recall >= 0.30",
            "oracle": "best test precision over min_prob cuts at test recall >= 0.30 (not a claim)",
            "auc": "test pairs that pass the guards, MLP probability",
            "align_features": list(ALIGN_NAMES),
            "hidden": args.hidden,
            "members": args.members,
        },
        "models": results,
        "serving_cost": cost,
        "univariate_auc_train_pairs_at_cosine_floor": uni,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / "verifier_token_alignment.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print_table(results)
    print("test precision at fixed recall (ranking cuts, ORACLE-style, mean over seeds):")
    for r in results:
        keys = r["runs"][0]["test_precision_at_recall"]
        cells = [f"{k}={np.mean([x['test_precision_at_recall'][k] for x in r['runs']]):.3f}" for k in keys]
        print(f"  {r['name']:<34} " + "  ".join(cells))
    print(f"\nunivariate AUC on train pairs at cosine >= floor: {json.dumps(uni)}")
    print(f"serving cost: {json.dumps(cost)}")
    print(f"wrote {path} in {out['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
