"""fastopt: fused, exact, layout-agnostic memory-efficient optimizers for PyTorch."""
from .distributed.zero import ZeroGradScaler, ZeroRedundancyOptimizer
from .optim.adafactor import Adafactor
from .optim.adamw8bit import AdamW8bit
from .optim.came import CAME
from .optim.galore import GaLoreAdamW, GaLoreAdamW8bit, get_galore_param_groups
from .optim.lamb import Lamb
from .quant import dequantize_blockwise, quantize_blockwise

__all__ = ["Adafactor", "Lamb", "CAME", "ZeroRedundancyOptimizer", "ZeroGradScaler", "AdamW8bit",
           "quantize_blockwise", "dequantize_blockwise", "GaLoreAdamW", "GaLoreAdamW8bit", "get_galore_param_groups"]
__version__ = "0.1.0"
