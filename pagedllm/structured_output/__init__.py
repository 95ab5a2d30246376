"""Structured outputs (constrained decoding): grammar backends (xgrammar, llguidance) behind one
interface, a bounded compile cache, per-request matchers, and per-step token bitmasks.

Importing this package (or ``.params`` / ``.config``) loads no torch and no grammar library;
the backends are imported when the manager first needs them.
"""
from pagedllm.structured_output.config import StructuredOutputsConfig
from pagedllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsConfig", "StructuredOutputsParams"]
