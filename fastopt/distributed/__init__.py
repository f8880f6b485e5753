"""Layouts and batched collectives; the ZeRO wrapper.

`declare_shard(p, global_shape, group, dim=... | flat_offset=...)` declares a plain tensor sharded by hand
(Megatron-style layers, flat ZeRO ranges); `declare_fsdp(model)` the pieces of FSDP1
(`FullyShardedDataParallel(use_orig_params=True)`); DTensor params (TP, FSDP2, both) need no declaration;
`FastOptimizer.setup_distributed(...)` takes ColossalAI's declaration. See layout.py.
"""
from .layout import Layout, declare_fsdp, declare_shard, full_tensor, layout_of
from .zero import ZeroGradScaler, ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer", "ZeroGradScaler", "Layout", "declare_fsdp", "declare_shard", "full_tensor",
           "layout_of"]
