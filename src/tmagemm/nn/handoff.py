"""``Handoff``: values one layer computed for a tensor, held for the layers a module calls next with
that same tensor (a stack's members, the layers a fused norm feeds).

A taker gets a value only when it is called with the very tensor the values were computed for,
unchanged since: eagerly its version counter must not have moved; ``torch.compile`` traces
functional graphs, where it cannot change between the calls, and resolves the identity while
tracing (the graph holds no trace of the hand-off). Any other call gets None, and the caller
computes the value itself, so results never depend on the order the model calls its modules.
Each value is taken once; once all are taken nothing is held.
"""

from __future__ import annotations

import torch


class Handoff:
    def __init__(self):
        self._held = None  # (x, x._version or None while compiling, [value per taker, None once taken])

    def hold(self, x: torch.Tensor, values: list) -> None:
        """Hold ``values`` (one per taker; None for none) for calls with ``x``."""
        version = None if torch.compiler.is_compiling() else x._version
        self._held = (x, version, values)

    def take(self, x: torch.Tensor, index: int | None = None):
        """Value ``index`` (None: the first one left) when ``x`` is the held tensor, unchanged
        since, and that value is still held; None otherwise."""
        held = self._held
        if held is None or held[0] is not x:
            return None
        if not torch.compiler.is_compiling() and held[1] != x._version:
            return None
        values = held[2]
        if index is None:
            index = next((i for i, v in enumerate(values) if v is not None), None)
            if index is None:
                return None
        value = values[index]
        values[index] = None
        if all(v is None for v in values):
            self._held = None  # every value taken: hold no activation
        return value

    def holding(self) -> bool:
        return self._held is not None

    def clear(self) -> None:
        self._held = None
