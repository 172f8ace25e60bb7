"""Speculative decoding: proposers (n-gram prompt lookup) and the config that selects them.

The scheduler side (which rows draft, how a verified run is accepted) lives in tandem/scheduler/speculative.py;
the device side (the FutureMap write of the last accepted token) in tandem/device/model_runner.py.
"""
from .config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
