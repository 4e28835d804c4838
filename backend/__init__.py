"""cachegw's built-in inference engine: a small paged-KV engine in the spirit of vLLM.

The public names load on first use, so tools that only read configuration (`cachegw analyze`)
do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "cachegw.backend.entrypoints.llm",
    "SamplingParams": "cachegw.backend.core.sampling_params",
    "InvalidParameter": "cachegw.backend.core.sampling_params",
    "RequestOutput": "cachegw.backend.core.outputs",
    "CompletionOutput": "cachegw.backend.core.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'backend' has no attribute {name!r}")
