"""Host syncs counted on the CPU: reads of a tensor back to the host, and tensors moved or made from host data for a
named device; on CUDA each makes the host wait for the device (a copy from pageable host memory too)."""

from __future__ import annotations

from collections import Counter
from functools import wraps

import pytest
import torch

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu")
"""Tensor methods that hand a value to the host."""
MOVES = ("to", "cuda")
"""Tensor methods that move a tensor to a device (counted when they name one: `.to(dtype)` is no move)."""
MAKERS = ("tensor", "as_tensor")
"""torch functions that make a tensor from host data (counted when they name a device)."""


def _syncs(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether this call reads back or moves host data to a device; args[0] is the tensor or the host data."""
    names_device = "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])
    return name in READS or name == "cuda" or names_device


def count_host_syncs(
    monkeypatch: pytest.MonkeyPatch, owner: object, methods: tuple[str, ...], moves: bool = True
) -> Counter:
    """Count every host sync (module docstring) made while one of `owner`'s `methods` runs -> a Counter by the
    method or function that made it, filled in as the code runs. moves=False counts the reads only: on the CPU a
    move to the tensor's own device (a no-op on CUDA too) looks like any other."""
    counts: Counter = Counter()
    running = [0]  # calls of `methods` under way

    def counted(name: str, original):
        @wraps(original)
        def call(*args, **kwargs):
            if running[0] and _syncs(name, args, kwargs):
                counts[name] += 1
            return original(*args, **kwargs)

        return call

    def watched(original):
        @wraps(original)
        def call(*args, **kwargs):
            running[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                running[0] -= 1

        return call

    for name in READS + (MOVES if moves else ()):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    for name in MAKERS if moves else ():
        monkeypatch.setattr(torch, name, counted(name, getattr(torch, name)))
    for method in methods:
        monkeypatch.setattr(owner, method, watched(getattr(owner, method)))
    return counts
