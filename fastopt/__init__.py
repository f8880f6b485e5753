"""fastopt: fused, exact, layout-agnostic memory-efficient optimizers for PyTorch."""
from .optim.adafactor import Adafactor
from .optim.lamb import Lamb
from .optim.came import CAME
from .distributed.zero import ZeroRedundancyOptimizer

__all__ = ["Adafactor", "Lamb", "CAME", "ZeroRedundancyOptimizer"]
__version__ = "0.1.0"

from .optim.adamw8bit import AdamW8bit  # noqa: E402
from .quant import dequantize_blockwise, quantize_blockwise  # noqa: E402

__all__ += ["AdamW8bit", "quantize_blockwise", "dequantize_blockwise"]

from .optim.galore import GaLoreAdamW, GaLoreAdamW8bit, get_galore_param_groups  # noqa: E402

__all__ += ["GaLoreAdamW", "GaLoreAdamW8bit", "get_galore_param_groups"]
