"""Attention over prefix caches lives in `chunkwise.models.attention`; this
name stays for callers of the inference package."""

from chunkwise.models.attention import PrefixLayer, attend

__all__ = ["PrefixLayer", "attend"]
