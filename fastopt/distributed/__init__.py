"""Layouts, batched collectives and the ZeRO wrapper."""
from .zero import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
