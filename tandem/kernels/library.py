"""Loading tandem's native library: built once (build.py), loaded into torch.ops.tandem, or the reason it
could not be (the torch path then runs)."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("tandem.kernels")

_loaded: bool | None = None
_error: str | None = None
_path: str | None = None        # the file loaded: its name holds the build key (build.py: sources, compiler, flags)
ISA_NAMES = ("scalar", "avx2", "avx512")


def available() -> bool:
    """True once torch.ops.tandem is loaded (building it first if needed); never raises."""
    global _loaded, _error, _path
    if _loaded is None:
        try:
            from .build import build
            path = build()
            torch.ops.load_library(path)
            _loaded, _path = True, path
        except Exception as e:  # no compiler, a failed build: the torch path still works
            _loaded, _error = False, str(e).splitlines()[0] if str(e) else type(e).__name__
            log.warning("tandem native kernels unavailable (%s); using the torch path", _error)
    return _loaded


def unavailable_reason() -> str | None:
    return _error


def loaded_library() -> str | None:
    """The library file loaded (None: none loaded)."""
    return _path


def isa(requested: int = -1) -> str:
    """The body the ops run here: 'avx512', 'avx2' or 'scalar' (TANDEM_ISA caps it)."""
    return ISA_NAMES[torch.ops.tandem.isa(requested)]
