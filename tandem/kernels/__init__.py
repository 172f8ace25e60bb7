"""tandem's native CPU kernels (C++ in csrc/, registered as torch.ops.tandem.*) and their torch references.

`available()` builds the library once (cached, see build.py) and loads it; callers fall back to the torch
path, with a log line, where it cannot be built. EngineConfig.kernels selects "native" or "torch".
"""
from __future__ import annotations

from .library import ISA_NAMES, available, isa, unavailable_reason
from .quant import NATIVE_QTYPES, QuantWeight, linear_rows

__all__ = ["available", "unavailable_reason", "isa", "ISA_NAMES", "NATIVE_QTYPES", "QuantWeight",
           "linear_rows"]
