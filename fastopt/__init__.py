"""fastopt: fused, exact, layout-agnostic memory-efficient optimizers for PyTorch."""
from .optim.adafactor import Adafactor

__all__ = ["Adafactor"]
__version__ = "0.1.0"
