"""Xirang: compile a single-device PyTorch model into a 3D-parallel training program."""
from .errors import PassFailure, PassOrderError, TraceError, XirangError

__all__ = ["XirangError", "TraceError", "PassOrderError", "PassFailure"]
