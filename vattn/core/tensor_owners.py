"""Which open KV cache holds a tensor's memory, found by address.

Every open :class:`vattn.KVCacheManager` registers the address span of its
reservation here (a :class:`CacheSpan`: the K/V buffers of all reqids and
their geometry). :func:`view_owner` maps a tensor back to its cache and the
(reqid, token) of its row 0, so a kernel handed a plain cache view, without
being told whose it is, can ask that cache which rows are mapped before it
reads them. This module knows addresses and strides only, no manager.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch


class CacheSpan:
    """One open cache's reservation as the address lookup sees it.

    Owned by its manager (which keeps it while open); the registry holds it
    weakly, so a collected manager's span leaves the registry with it.
    """

    __slots__ = ("low", "high", "buffer_bytes", "slice_bytes", "token_bytes", "device_type", "pages",
                 "__weakref__")

    def __init__(self, low: int, high: int, buffer_bytes: int, slice_bytes: int, token_bytes: int,
                 device_type: str, pages: Any) -> None:
        self.low, self.high = low, high  # addresses: [low, high) holds every buffer
        self.buffer_bytes = buffer_bytes  # one K or V buffer, all reqids
        self.slice_bytes = slice_bytes  # one reqid's slice of one buffer
        self.token_bytes = token_bytes  # one token's row of one buffer (every layer's, in all_layers)
        self.device_type = device_type  # "cpu" or "cuda"
        self.pages = pages  # the core's page manager, which answers check_mapped and counts shrinks

    def _place(self) -> tuple:
        return self.low, self.high, self.buffer_bytes, self.slice_bytes, self.token_bytes, self.device_type

    def __eq__(self, other: object) -> bool:
        """The same addresses and geometry (a cache opened where a closed one was)."""
        return isinstance(other, CacheSpan) and self._place() == other._place()

    __hash__ = None  # type: ignore[assignment]  # equal spans of different caches must not share a dict entry


# (first address, end, span) of every open cache: a tuple replaced whole under
# _spans_lock, so readers need no lock. A span leaves it when its manager
# closes (its addresses may then be reused by another cache) or is collected.
_spans: tuple[tuple[int, int, weakref.ref[CacheSpan]], ...] = ()
_spans_lock = threading.Lock()


def remember_span(span: CacheSpan) -> None:
    """Registers an open cache's span for :func:`span_of` and :func:`view_owner`."""
    global _spans
    with _spans_lock:
        _spans = (*_spans, (span.low, span.high, weakref.ref(span, forget_span)))


def forget_span(gone: CacheSpan | weakref.ref[CacheSpan]) -> None:
    """Drops a span (its cache closed, or the span was collected)."""
    global _spans
    with _spans_lock:
        _spans = tuple(s for s in _spans if s[2] is not gone and s[2]() is not gone and s[2]() is not None)


def span_of(tensor: torch.Tensor) -> CacheSpan | None:
    """The open cache whose memory holds ``tensor``'s first element, or None
    for any other tensor (a closed cache's views included: they read the
    memory they kept, like plain tensors)."""
    address = tensor.data_ptr()
    for low, high, ref in _spans:
        if low <= address < high:
            span = ref()
            if span is not None and span.device_type == tensor.device.type:
                return span
    return None


def view_origin(span: CacheSpan, view: torch.Tensor, what: str) -> tuple[int, int]:
    """The (reqid, token) of a cache view's row 0, after checking that its
    reqid and token strides are the cache's (``ValueError`` starting with
    ``what`` otherwise). Views of every layer share their origin."""
    size = view.element_size()
    if view.dim() != 4 or view.stride(0) * size != span.slice_bytes or view.stride(1) * size != span.token_bytes:
        raise ValueError(f"{what}: a view of the vattn cache must have its reqid and token strides "
                         f"({span.slice_bytes} and {span.token_bytes} bytes), got shape "
                         f"{tuple(view.shape)} and strides {tuple(view.stride())} (elements of {size} bytes)")
    offset = (view.data_ptr() - span.low) % span.buffer_bytes
    return offset // span.slice_bytes, offset % span.slice_bytes // span.token_bytes


# A 4-d cache view's (data pointer, reqid stride, token stride, element size, on the CPU) -> (the _spans it
# was found under, its span, its origin). Plain views are handed to the function API anew each call (vLLM
# indexes kv_cache[0] per layer), so without it each call would search the spans and check the strides
# again. An entry is used only while _spans is the tuple it was found under: a closed cache's addresses
# never resolve to it.
_view_owners: dict[tuple, tuple[tuple, weakref.ref[CacheSpan], tuple[int, int]]] = {}
_VIEW_OWNERS_MAX = 4096  # views of distinct places remembered; past it, forgotten all at once


def view_owner(view: torch.Tensor, what: str) -> tuple[CacheSpan, tuple[int, int]] | None:
    """``(span, origin)`` of a 4-d view of an open cache (:func:`span_of`,
    :func:`view_origin`), or None for any other tensor. Raises ``ValueError``
    starting with ``what`` when the view's reqid and token strides are not
    the cache's. Remembered per place and strides."""
    key = (view.data_ptr(), view.stride(0), view.stride(1), view.element_size(), view.is_cpu)
    spans = _spans
    known = _view_owners.get(key)
    if known is not None and known[0] is spans:
        span = known[1]()
        if span is not None:
            return span, known[2]
    span = span_of(view)
    if span is None:
        return None
    origin = view_origin(span, view, what)  # raises for foreign strides: never remembered
    if len(_view_owners) >= _VIEW_OWNERS_MAX:
        _view_owners.clear()
    _view_owners[key] = (spans, weakref.ref(span), origin)
    return span, origin
