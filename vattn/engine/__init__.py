"""A small continuous-batching serving engine over a transformers causal LM,
with vattn as its KV cache: an application built on vattn's primitives, not a
framework integration (see docs/engine.md)."""

from .engine import Engine, GenerateError, RequestOutput

__all__ = ["Engine", "GenerateError", "RequestOutput"]
