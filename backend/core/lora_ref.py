"""Which LoRA adapter a request runs under: what the scheduler's batch, the runner and the prefix
cache need to know of it, and no weights."""

from __future__ import annotations

from dataclasses import dataclass

from cachegw.backend.core.sampling_params import InvalidParameter


@dataclass(frozen=True)
class LoRARef:
    """An adapter as loaded: its served ``name``, the weight ``slot`` it occupies and the ``digest``
    of its files. The digest, not the name, keys its prefix-cache blocks: an adapter unloaded and
    another loaded under the same name never reuses the first one's KV, and the same files loaded
    again (or after a restart, from the disk tier) do."""

    name: str
    slot: int
    digest: str


class UnknownModel(InvalidParameter):
    """The request names a model this engine does not serve (an adapter unloaded meanwhile): a 404."""

    code = "model_not_found"
    status = 404

    def __init__(self, name: str) -> None:
        super().__init__("model", f"The model `{name}` does not exist.")
