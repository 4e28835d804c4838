"""A user message split into blocks: code, quoted text, a long document, and the instruction around them.

The semantic tier compares meanings, but a message that carries a document, an e-mail or code is a
different request as soon as that material changes, whatever the instruction says, and the query encoder
reads only its first 256 word pieces. So the material is set apart: it must match exactly (up to
whitespace), and only the instruction is judged by meaning.

- Code: fenced blocks (```, ~~~) and runs of code-like lines (symbol-dense, indented or starting with a
  keyword); inline `code` is checked where the instruction differs (``policies/pair_diff.py``).
- Quotes: lines starting with ``>``.
- Documents: in a message longer than ``LONG_WORDS`` words every block between the first and the last is
  material, and so is a long first or last paragraph except an instruction sentence peeled off it: a
  first sentence ending in ":" ("Summarize the following:"), else the last sentence of the message when
  no instruction came before it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

LONG_WORDS = 60  # a paragraph longer than this is material, not an instruction
_FENCE_RE = re.compile(r"^[ \t]*(```|~~~)[^\n]*\n.*?^[ \t]*\1[ \t]*$", re.MULTILINE | re.DOTALL)
_PARAGRAPH_RE = re.compile(r"\n[ \t]*\n")
_WORD_RE = re.compile(r"\w+")
_SENTENCE_END_RE = re.compile(r"(?<=[.!?:])\s+(?=\S)")
_CODE_START_RE = re.compile(
    r"^\s*(?:def|class|import|from \S+ import|return|function|const|let|var|public|private|static|void|"
    r"int|#include|using|package|func|fn|SELECT|INSERT|UPDATE|DELETE|CREATE|if\s*\(|for\s*\(|while\s*\(|"
    r"}|{|\$ |>>> )",
)
_CODE_CHARS = frozenset("{}[]();=<>+-*/%&|!^~:#\\\"'_.")


@dataclass(frozen=True)
class Block:
    kind: str  # "code", "quote", "doc" (material) or "text" (instruction)
    text: str

    @property
    def material(self) -> bool:
        return self.kind != "text"

    @property
    def key(self) -> str:
        """What must be equal for two blocks to be the same: the text up to whitespace (and case, for
        prose instructions, which are compared by meaning anyway)."""
        squashed = " ".join(self.text.split())
        return f"{self.kind}:{squashed.lower() if self.kind == 'text' else squashed}"


def words(text: str) -> int:
    return len(_WORD_RE.findall(text))


def code_like(line: str) -> bool:
    """A line that reads as code: a keyword start, or dense in symbols with few plain words between."""
    s = line.strip()
    if not s:
        return False
    if _CODE_START_RE.match(line) and (len(s) < 4 or s[-1] not in ".?!" or s.endswith("()")):
        return True
    symbols = sum(ch in _CODE_CHARS for ch in s)
    if s.endswith((";", "{", "}", ") {", "):")) and symbols >= 2:
        return True
    return symbols >= 3 and symbols / max(len(s.replace(" ", "")), 1) >= 0.15 and " " in s.strip()[:40]


def _paragraph_blocks(paragraph: str) -> list[Block]:
    """Runs of quoted lines, code-like lines and plain lines inside one paragraph. A one-line paragraph
    is code when it reads as code and does not end like a sentence: "Is 2+2=4 in base 3?" is prose."""
    lines = paragraph.strip("\n").split("\n")
    if len(lines) == 1:
        s = lines[0].strip()
        single_code = (bool(_CODE_START_RE.match(s)) or code_like(s)) and not s.endswith(("?", "."))
        kind = (
            "quote" if s.startswith(">") else "code" if single_code or s.endswith((";", "{", "}")) else "text"
        )
        return [Block(kind, lines[0])]
    out: list[Block] = []
    for line in lines:
        kind = "quote" if line.lstrip().startswith(">") else "code" if code_like(line) else "text"
        if out and out[-1].kind == kind:
            out[-1] = Block(kind, out[-1].text + "\n" + line)
        else:
            out.append(Block(kind, line))
    return out


def _sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END_RE.split(text.strip()) if s]


@lru_cache(maxsize=4096)
def split_message(text: str) -> tuple[Block, ...]:
    """The message's blocks in order; adjacent text lines of one paragraph form one block."""
    blocks: list[Block] = []
    pos = 0
    for m in _FENCE_RE.finditer(text):
        for para in _PARAGRAPH_RE.split(text[pos : m.start()]):
            if para.strip():
                blocks += _paragraph_blocks(para)
        blocks.append(Block("code", m.group(0).strip()))
        pos = m.end()
    for para in _PARAGRAPH_RE.split(text[pos:]):
        if para.strip():
            blocks += _paragraph_blocks(para)
    if sum(words(b.text) for b in blocks) <= LONG_WORDS:
        return tuple(blocks)
    out: list[Block] = []
    last = len(blocks) - 1
    for i, b in enumerate(blocks):
        if b.kind != "text":
            out.append(b)
        elif 0 < i < last:
            out.append(Block("doc", b.text))
        elif words(b.text) <= LONG_WORDS:
            out.append(b)
        else:
            has_instruction = any(x.kind == "text" for x in out)
            out += _peel(b.text, first=i == 0, last=i == last and not has_instruction)
    return tuple(out)


def _peel(text: str, first: bool, last: bool) -> list[Block]:
    """A long first or last paragraph: the material, with an instruction sentence on one end."""
    sents = _sentences(text)
    head: list[Block] = []
    tail: list[Block] = []
    if first and len(sents) > 1 and sents[0].endswith(":") and words(sents[0]) <= LONG_WORDS:
        head.append(Block("text", sents.pop(0)))
    if last and not head and len(sents) > 1 and words(sents[-1]) <= LONG_WORDS:
        tail.append(Block("text", sents.pop()))
    return [*head, Block("doc", " ".join(sents)), *tail]
