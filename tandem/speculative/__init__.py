"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the config that selects them, and
the branch's engine-wide state and rules (speculation.py: Speculation).

Which rows draft lives in tandem/scheduler/speculative.py; the acceptance rule of a verified run, shared by the
device (the FutureMap write of the last accepted token) and process results, in tandem/device/verify.py.
"""
from .config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
