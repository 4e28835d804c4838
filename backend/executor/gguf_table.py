"""A GGUF file's tensor table, read without its metadata values.

gguf's ``GGUFReader`` turns every metadata field into numpy arrays, the tokenizer's 49k tokens and
merges included: about 160 MiB of passing memory for SmolLM2, more than its weights take. The
engine needs only the architecture's name and where each tensor lies; this reader skips the rest
(its lengths only) and hands out each tensor as a view of one read-only memory map, whose pages a
loader gives back once it has read a tensor (``release_pages``).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FLOAT_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
}


@dataclass(frozen=True)
class TableTensor:
    """One tensor: its GGUF name, type and data (rows x bytes per row for block types; the float
    array itself for F32/F16/F64), a view of the file's memory map."""

    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", "replace")

    def skip(self, vtype: int) -> None:
        if vtype == _STRING:
            n = self.take("Q")  # read before the position moves
            self.pos += n
        elif vtype == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALAR_SIZES:
                self.pos += _SCALAR_SIZES[item] * count
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            self.pos += _SCALAR_SIZES[vtype]


def release_pages(data: np.ndarray) -> None:
    """Drop the pages of a tensor read from the map out of this process (they stay in the page cache):
    read one tensor at a time, the loader never holds the whole file beside the weights built from it.
    A page shared with the next tensor is read again when that one is."""
    region = getattr(data, "_mmap", None)
    if region is None or data.nbytes == 0:
        return
    base = np.frombuffer(region, dtype=np.uint8).ctypes.data
    start = data.ctypes.data - base
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    region.madvise(mmap.MADV_DONTNEED, first, start + data.nbytes - first)


def string_field(path: Path, key: str) -> str | None:
    """One string-valued metadata field (``tokenizer.ggml.pre``...), every other value skipped."""
    mm = np.memmap(path, mode="r")
    cur = _Cursor(mm.data)
    if bytes(mm[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 8
    _, n_fields = cur.take("Q"), cur.take("Q")
    for _ in range(n_fields):
        name, vtype = cur.string(), cur.take("I")
        if name == key and vtype == _STRING:
            return cur.string()
        cur.skip(vtype)
    return None


def read_table(path: Path) -> tuple[str, list[TableTensor]]:
    """The file's architecture ("llama", "qwen2", ...) and its tensors, nothing read but the header."""
    mm = np.memmap(path, mode="r")
    cur = _Cursor(mm.data)
    if bytes(mm[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    if cur.take("I") not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version")
    n_tensors, n_fields = cur.take("Q"), cur.take("Q")
    arch, alignment = "", 32
    for _ in range(n_fields):
        key, vtype = cur.string(), cur.take("I")
        if key == "general.architecture" and vtype == _STRING:
            arch = cur.string()
        elif key == "general.alignment" and vtype == 4:
            alignment = cur.take("I")
        else:
            cur.skip(vtype)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        infos.append((name, GGMLQuantizationType(cur.take("I")), dims, cur.take("Q")))
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, kind, dims, offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        row_bytes = dims[0] // block * size
        raw = mm[start + offset : start + offset + rows * row_bytes]
        if kind in _FLOAT_DTYPES:
            data = raw.view(_FLOAT_DTYPES[kind]).reshape([*reversed(dims)])
        else:
            data = raw.reshape(rows, row_bytes)
        tensors.append(TableTensor(name, kind, data))
    return arch, tensors
