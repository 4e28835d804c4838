"""Write bench/data/verifier_families.jsonl: labelled query pairs in families real clients send.

Families (label 1 = the stored answer fits the new query):
- doc_instruction: a document (or e-mail, report) with an instruction; same document, paraphrased (1) or
  different (0) instruction (another task, or a near miss one or two words away: "into French" / "into
  German"), the instruction after, before or in the same paragraph as the document. Positives are loose
  paraphrases ("Summarize this in one sentence." / "Sum up the text above in a single sentence.") and
  light rewordings ("Summarise this in one sentence please.").
- long_tail: 900+ word messages sharing everything but their last line (paraphrased: 1, different: 0).
- code: one code snippet with a question; a one-token edit of the code (0), another question one or two
  words away (0) or a paraphrased or lightly reworded question (1).
- units: the same amount in other units (1) or the same digits in other units (0).
- yesno_flip: a yes/no question and the same with one opposite word (0), or reworded (1).
- device_action: a device command and its opposite (0) or a paraphrase (1).
- paraphrase: everyday questions reworded (1).

Pairs are built from hand-written material (bench/family_material.py) through templates. Each pair is
in the ``tune`` or ``heldout`` split by its material (a document, a snippet, a template), so held-out
pairs never share their material with the pairs any rule was tuned on.

    python bench/make_verifier_families.py
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import family_material as M  # noqa: E402

OUT = ROOT / "bench" / "data" / "verifier_families.jsonl"
TUNE_PERCENT = 40


def split_of(material: str) -> str:
    return "tune" if int(hashlib.sha1(material.encode()).hexdigest(), 16) % 100 < TUNE_PERCENT else "heldout"


def layout(doc: str, instruction: str, how: int) -> str:
    if how == 0:
        return f"{doc}\n\n{instruction}"
    if how == 1:
        return f"{instruction}\n\n{doc}"
    return f"{doc} {instruction}"


def doc_instruction(rng: random.Random) -> list[dict]:
    rows = []
    groups = M.INSTRUCTION_GROUPS
    for d, doc in enumerate(M.DOCUMENTS):
        how = d % 3
        for g in rng.sample(range(len(groups)), 4):
            a, b = rng.sample(groups[g], 2)
            rows.append(("doc_instruction", f"doc{d}", 1, layout(doc, a, how), layout(doc, b, how)))
            other = rng.choice([h for h in range(len(groups)) if h != g])
            rows.append(
                ("doc_instruction", f"doc{d}", 0, layout(doc, a, how), layout(doc, groups[other][0], how))
            )
        for x, y in rng.sample(M.NEAR_MISS_INSTRUCTIONS, 2):  # one word apart, another request
            rows.append(("doc_instruction", f"doc{d}", 0, layout(doc, x, how), layout(doc, y, how)))
        for x, y in rng.sample(M.REWORDED_INSTRUCTIONS, 2):  # the same request reworded lightly
            rows.append(("doc_instruction", f"doc{d}", 1, layout(doc, x, how), layout(doc, y, how)))
    return [_row(*r) for r in rows]


def long_tail(rng: random.Random) -> list[dict]:
    rows = []
    groups = M.INSTRUCTION_GROUPS
    for k in range(36):
        docs = rng.sample(M.DOCUMENTS, 10)
        body = "\n\n".join(docs)  # about 950 words: far past the encoder's 256 word pieces
        g = rng.randrange(len(groups))
        a, b = rng.sample(groups[g], 2)
        other = groups[rng.choice([h for h in range(len(groups)) if h != g])][0]
        label = k % 2
        near = M.NEAR_MISS_INSTRUCTIONS[k % len(M.NEAR_MISS_INSTRUCTIONS)]
        if not label and k % 4 == 0:
            a, other = near
        if label and k % 4 == 1:
            a, b = M.REWORDED_INSTRUCTIONS[k % len(M.REWORDED_INSTRUCTIONS)]
        last = b if label else other
        rows.append(_row("long_tail", f"long{k}", label, f"{body}\n\n{a}", f"{body}\n\n{last}"))
    return rows


def _code_layout(code: str, question: str, how: int) -> str:
    if how == 0:
        return f"{question}\n\n```\n{code}\n```"
    if how == 1:
        return f"```\n{code}\n```\n\n{question}"
    return f"{code}\n\n{question}"


def code(rng: random.Random) -> list[dict]:
    rows = []
    for s, (snippet, edits) in enumerate(M.CODE_SNIPPETS):
        how = s % 3
        for old, new in edits:
            q = rng.choice(rng.choice(M.CODE_QUESTION_GROUPS))
            edited = snippet.replace(old, new, 1)
            rows.append(
                _row("code", f"code{s}", 0, _code_layout(snippet, q, how), _code_layout(edited, q, how))
            )
        x, y = M.CODE_NEAR_MISS_QUESTIONS[s % len(M.CODE_NEAR_MISS_QUESTIONS)]
        rows.append(_row("code", f"code{s}", 0, _code_layout(snippet, x, how), _code_layout(snippet, y, how)))
        x, y = M.REWORDED_CODE_QUESTIONS[s % len(M.REWORDED_CODE_QUESTIONS)]
        rows.append(_row("code", f"code{s}", 1, _code_layout(snippet, x, how), _code_layout(snippet, y, how)))
        for g in rng.sample(range(len(M.CODE_QUESTION_GROUPS)), 3):
            a, b = rng.sample(M.CODE_QUESTION_GROUPS[g], 2)
            rows.append(
                _row("code", f"code{s}", 1, _code_layout(snippet, a, how), _code_layout(snippet, b, how))
            )
    return rows


_UNIT_KIND = {
    "km": "d", "kilometres": "d", "m": "d", "miles": "d", "mi": "d", "cm": "d", "inches": "d",
    "kg": "w", "g": "w", "lbs": "w", "pounds": "w", "mg": "w", "milligrams": "w", "grams": "w",
    "ml": "v", "l": "v", "L": "v", "litres": "v", "gallons": "v",
    "°C": "t", "°F": "t", "GB": "s", "MB": "s", "gigabytes": "s",
    "minutes": "h", "hours": "h", "seconds": "h",
}  # fmt: skip
_TEMPLATE_KIND = ["d", "d", "d", "v", "w", "w", "w", "t", "s", "h", "d", "w", "v", "s", "h", "t"]
_EXTRA_TEMPLATES = [
    "What pace do I need to run {q} in under an hour?",
    "How much protein is in {q} of chicken?",
    "How many cups is {q} of milk?",
    "How long does it take to download a {q} file?",
    "Is {q} too long for a nap?",
    "What should I wear when it is {q} outside?",
]


def _kind(quantity: str) -> str:
    unit = quantity.split()[-1] if " " in quantity else quantity.lstrip("0123456789.")
    return _UNIT_KIND[unit]


def units(rng: random.Random) -> list[dict]:
    rows = []
    templates = M.UNIT_TEMPLATES + _EXTRA_TEMPLATES
    for t, template in enumerate(templates):
        kind = _TEMPLATE_KIND[t]
        for label, pairs in ((1, M.UNIT_SAME), (0, M.UNIT_DIFFERENT)):
            fitting = [p for p in pairs if _kind(p[0]) == kind]
            for x, y in rng.sample(fitting, min(3, len(fitting))):
                rows.append(_row("units", f"units{t}", label, template.format(q=x), template.format(q=y)))
    return rows


def yesno_flip(rng: random.Random) -> list[dict]:
    rows = [_row("yesno_flip", f"yesno_hand{i}", 0, a, b) for i, (a, b) in enumerate(M.YESNO_FLIPS)]
    for i, (pos, neg) in enumerate(M.YESNO_TEMPLATE_ADJ):
        for act in rng.sample(M.YESNO_TEMPLATE_ACTS, 3):
            material = f"yesno_adj{i}"
            rows.append(_row("yesno_flip", material, 0, f"Is it {pos} {act}?", f"Is it {neg} {act}?"))
            rows.append(_row("yesno_flip", material, 1, f"Is it {pos} {act}?", f"Would it be {pos} {act}?"))
    return rows


def device_action(rng: random.Random) -> list[dict]:
    rows = []
    for i, (act, opposite, para) in enumerate(M.DEVICE_ACTIONS):
        for d in rng.sample(M.DEVICES, 4):
            rows.append(_row("device_action", f"dev{i}", 0, act.format(d=d), opposite.format(d=d)))
            rows.append(_row("device_action", f"dev{i}", 1, act.format(d=d), para.format(d=d)))
    return rows


def paraphrase(rng: random.Random) -> list[dict]:
    return [_row("paraphrase", f"para{i}", 1, a, b) for i, (a, b) in enumerate(M.PARAPHRASES)]


def _row(family: str, material: str, label: int, q1: str, q2: str) -> dict:
    return {"family": family, "split": split_of(material), "material": material, "label": label,
            "question1": q1, "question2": q2}  # fmt: skip


def build(seed: int = 12) -> list[dict]:
    rng = random.Random(seed)
    rows: list[dict] = []
    for make in (doc_instruction, long_tail, code, units, yesno_flip, device_action, paraphrase):
        rows += make(rng)
    return rows


def main() -> int:
    rows = build()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    counts: dict[tuple[str, str, int], int] = {}
    for r in rows:
        k = (r["family"], r["split"], r["label"])
        counts[k] = counts.get(k, 0) + 1
    for k in sorted(counts):
        print(*k, counts[k])
    print(f"wrote {len(rows)} pairs to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
