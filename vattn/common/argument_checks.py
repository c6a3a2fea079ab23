"""Checks and conversions of the public API's arguments: ints, int arrays,
page-id rows and CUDA stream handles (the policy knobs are checked where
they are described: vattn/core/policy.py). Each raises ``TypeError`` /
``ValueError`` naming the argument and the accepted range."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def as_int(name: str, value: object, limit: int = 2**63) -> int:
    """``value`` as an int in ``[-limit, limit)``: ints and integer scalars, not bools or floats."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or isinstance(value, float):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    out = int(value.__index__())  # type: ignore[attr-defined]
    if not -limit <= out < limit:
        raise ValueError(f"{name} must be below {limit}, got {out}")
    return out


def bounded_int(name: str, value: object, count: int) -> int:
    """An int index in ``[0, count)``, with an error naming the argument and the range."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or isinstance(value, float):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    out = int(value.__index__())  # type: ignore[attr-defined]
    if not 0 <= out < count:
        raise ValueError(f"{name} must be in [0, {count - 1}], got {out}")
    return out


def int_array(name: str, values: object) -> Any:
    """What the core reads as a 1-D int array: lists, tuples and numpy arrays
    pass as they are; tensors must be CPU integer tensors (any stride)."""
    if type(values) is list or type(values) is tuple:  # first: isinstance(torch.Tensor) costs ~0.06 us
        return values
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor or a list, got a tensor on {values.device}")
        if values.dtype == torch.bool or values.is_floating_point() or values.is_complex():
            raise TypeError(f"{name} must hold integers, got a {values.dtype} tensor")
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        return values.numpy()
    return values


def page_id_rows(page_ids: object) -> tuple[list[int], list[int]]:
    """``map_pages``'s ``page_ids`` without ``counts`` (one sequence of ids
    per request) as the counts and the flat ids the core takes."""
    shape = "one sequence of page ids per request, e.g. [[3, 7], [3]] (flat ids need counts=)"
    array = isinstance(page_ids, (torch.Tensor, np.ndarray))
    if isinstance(page_ids, (str, bytes)) or not hasattr(page_ids, "__iter__") or (array and page_ids.ndim != 2):
        what = f"a {page_ids.ndim}-D array" if array else type(page_ids).__name__  # type: ignore[union-attr]
        raise TypeError(f"map_pages: page_ids must be {shape}, got {what}")
    rows = []
    for i, row in enumerate(page_ids):  # type: ignore[union-attr]
        if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
            raise TypeError(f"map_pages: page_ids must be {shape}; page_ids[{i}] is "
                            f"{type(row).__name__} {row!r}, not a sequence")
        rows.append(list(int_array("page_ids", row)))
    return [len(row) for row in rows], [i for row in rows for i in row]


_CU_STREAM_PER_THREAD = 0x2  # cuda.h


def stream_handles(streams: Any) -> list[int]:
    """Raw stream handles (ints) of ``streams``: None, a stream (an int or an
    object with ``.cuda_stream``, as torch.cuda.Stream) or a sequence of them."""
    if streams is None:
        return []
    if isinstance(streams, int) or hasattr(streams, "cuda_stream"):
        streams = [streams]
    if isinstance(streams, (str, bytes)) or not hasattr(streams, "__iter__"):
        raise TypeError(f"sync_streams must be a stream, a raw stream handle (int) or a sequence of them, "
                        f"got {type(streams).__name__}")
    handles = []
    for s in streams:
        handle = getattr(s, "cuda_stream", s)
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise TypeError(f"sync_streams entries must be streams (with .cuda_stream) or raw handles (int), "
                            f"got {type(s).__name__}")
        if not 0 <= handle < 2**64:
            raise ValueError(f"sync_streams: a raw stream handle must be in [0, 2^64), got {handle}")
        if handle == _CU_STREAM_PER_THREAD:  # vattn's waits run on other threads (the mapper's)
            raise ValueError("sync_streams: 2 is CU_STREAM_PER_THREAD, a different stream on every thread, so "
                             "vattn's fences could not name the caller's; name a created stream or the legacy "
                             "default stream (0)")
        handles.append(handle)
    return handles
