"""KV cache groups: which layers share a block table (the hybrid sliding-window KV cache of Gemma 2 / 3).

A model whose layers all attend alike (full attention, or one sliding window for every layer, as Mistral) has one
group: one block table per request serves every layer. A model that mixes sliding-window layers with global ones
(Gemma 3: five local layers per global one) would waste most of its KV memory on positions its local layers can
no longer see, so its layers are split into groups of equal size, each of one attention kind, and each group
gets its own block table per request (vLLM's hybrid KV cache manager, docs/design/hybrid_kv_cache_manager.md):
a sliding group releases the blocks that left its window, a full group keeps every block. All groups draw their
blocks ("pages") from one pool, so memory moves between kinds as requests need it. Layer j of every group writes
the same physical tensor, its `slot`: a page holds the K/V of `group size` layers, for whichever group owns it.

Plain Python, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers whose K/V one block table addresses."""

    layers: tuple[int, ...]  # model layer indices, ascending; layer layers[j] uses physical slot j
    sliding_window: int | None  # tokens each query of these layers sees (query included); None = full attention


def kv_cache_groups(layer_windows: list[int | None]) -> list[KVCacheGroup]:
    """Split layers into KV cache groups by attention kind.

    Args:
        layer_windows: each layer's sliding window in tokens, None for full attention.

    Returns:
        One group of every layer when all layers attend alike; else groups of gcd(layers of each kind) layers,
        full-attention groups first, each kind's layers in order.

    Raises:
        ValueError: no layers.
    """
    if not layer_windows:
        raise ValueError("layer_windows: a model needs at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1:
        ((window, layers),) = kinds.items()
        return [KVCacheGroup(tuple(layers), window)]
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))  # full attention first, then by window
    return [KVCacheGroup(tuple(kinds[w][i : i + size]), w) for w in order for i in range(0, len(kinds[w]), size)]


def layer_slots(groups: list[KVCacheGroup], num_layers: int) -> tuple[list[int], list[int]]:
    """(group index of each layer, physical slot of each layer) for `groups` over `num_layers` layers."""
    group_of, slot_of = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            group_of[layer], slot_of[layer] = g, j
    return group_of, slot_of


__all__ = ["KVCacheGroup", "kv_cache_groups", "layer_slots"]
