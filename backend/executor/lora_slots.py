"""The model's LoRA slots: which adapter each holds, and the rows of each in the step being run.

With ``[engine] max_loras`` > 0 every attention and MLP projection is wrapped in a ``LoRALinear``
holding ``max_loras`` slots of zeros at ``max_lora_rank``; loading an adapter writes its matrices into
a free slot, unloading forgets its name. A slot is free when no adapter holds it and no request
still running was admitted under it, so a request keeps its weights to the end even when its
adapter is unloaded meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from cachegw.backend.config import EngineConfig
from cachegw.backend.core.lora_ref import LoRARef, UnknownModel
from cachegw.backend.core.sequence import Sequence
from cachegw.backend.executor.layers.lora_linear import LoRABatch, LoRALinear
from cachegw.backend.executor.lora_adapter import AdapterError, LoRAWeights, projection_shapes, read_adapter
from cachegw.backend.executor.models.llama import LlamaForCausalLM, ModelSpec

log = logging.getLogger("cachegw.backend")

# our (fused) projection -> the PEFT targets it holds, in the order of its output rows
_WRAPPED = {
    ("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
    ("self_attn", "o_proj"): ("o_proj",),
    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"),
    ("mlp", "down_proj"): ("down_proj",),
}


class SlotsFull(ValueError):
    """Every slot holds an adapter (or one a running request still uses): a 409."""


class LoRASlots:
    def __init__(
        self, model: LlamaForCausalLM, spec: ModelSpec, slots: int, rank: int, base_name: str
    ) -> None:
        self.spec, self.num_slots, self.rank, self.base_name = spec, slots, rank, base_name
        self.batch = LoRABatch(slots, rank)
        self.loaded: dict[str, LoRARef] = {}
        shapes = projection_shapes(spec)
        # per layer: (wrapped layer, its targets) for each projection
        self.layers: list[list[tuple[LoRALinear, tuple[str, ...]]]] = []
        for layer in model.layers:
            wrapped = []
            for (part, attr), targets in _WRAPPED.items():
                owner = getattr(layer, part, None)
                if not isinstance(getattr(owner, attr, None), torch.nn.Module):
                    raise AdapterError(
                        f"LoRA adapters are not served on {spec.architecture} models ([engine] max_loras)"
                    )
                lora = LoRALinear(
                    getattr(owner, attr),
                    shapes[targets[0]][0],
                    [shapes[t][1] for t in targets],
                    self.batch,
                )
                setattr(owner, attr, lora)
                wrapped.append((lora, targets))
            self.layers.append(wrapped)

    @property
    def bytes_per_slot(self) -> int:
        return 4 * sum(lora.slot_numel for layer in self.layers for lora, _ in layer)

    def ref(self, name: str) -> LoRARef | None:
        return self.loaded.get(name)

    def check(self, ref: LoRARef | None) -> None:
        """A request's adapter must still be the one loaded under its name when the engine takes it."""
        if ref is not None and self.loaded.get(ref.name) != ref:
            raise UnknownModel(ref.name)

    def read(self, path: str | Path) -> LoRAWeights:
        """The adapter's weights, checked (AdapterError): file work, kept apart from ``install``."""
        return read_adapter(path, self.spec, self.rank, self.base_name)

    def install(self, name: str, weights: LoRAWeights, busy: Iterable[int] = ()) -> LoRARef:
        """Write the adapter into a free slot (one outside ``busy``: the slots running requests use)."""
        if name in self.loaded:
            raise AdapterError(f"an adapter named {name!r} is loaded already: unload it first")
        taken = {r.slot for r in self.loaded.values()} | set(busy)
        slot = next((s for s in range(self.num_slots) if s not in taken), None)
        if slot is None:
            raise SlotsFull(
                f"all {self.num_slots} LoRA slots ([engine] max_loras) hold adapters or serve running "
                "requests: unload one, or retry when its requests end"
            )
        for layer, wrapped in enumerate(self.layers):
            for lora, targets in wrapped:
                for shard, target in enumerate(targets):
                    lora.set_slot(slot, shard, weights.modules.get((layer, target)))
        ref = LoRARef(name, slot, weights.digest)
        self.loaded[name] = ref
        log.info("LoRA %s (rank %d, %s) in slot %d", name, weights.rank, weights.path, slot)
        return ref

    def remove(self, name: str) -> LoRARef:
        ref = self.loaded.pop(name, None)
        if ref is None:
            raise UnknownModel(name)
        log.info("LoRA %s unloaded (slot %d)", name, ref.slot)
        return ref

    def set_batch(self, seqs: list[Sequence], num_tokens: list[int]) -> bool:
        """Point the LoRA layers at this step's rows of each slot; True when any adapter is in it."""
        slot_of_row: list[int] = []
        for seq, n in zip(seqs, num_tokens, strict=True):
            slot_of_row += [-1 if seq.params.lora is None else seq.params.lora.slot] * n
        device = self.layers[0][0][0].device
        if all(s < 0 for s in slot_of_row):
            if self.batch.segments:
                self.batch.set([], device)
            return False
        self.batch.set(slot_of_row, device)
        return True


def lora_slots_for(
    config: EngineConfig, model: LlamaForCausalLM, spec: ModelSpec, base_name: str
) -> LoRASlots | None:
    """The slots ``[engine]`` asks for, with ``lora_modules`` loaded; None when LoRA is off. An adapter
    that cannot be served stops the start with the reason."""
    if not config.max_loras:
        return None
    slots = LoRASlots(model, spec, config.max_loras, config.max_lora_rank, base_name)
    for name, path in config.lora_modules.items():
        try:
            slots.install(name, slots.read(path))
        except AdapterError as exc:
            raise AdapterError(f"[engine] lora_modules.{name}: {exc}") from None
    log.info(
        "LoRA: %d slots at rank %d (%.1f MiB each), %d loaded",
        slots.num_slots, slots.rank, slots.bytes_per_slot / 2**20, len(slots.loaded),
    )  # fmt: skip
    return slots
