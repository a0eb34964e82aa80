"""Build an engine's target (and draft model) from its `EngineConfig`, on the configured backend."""

from __future__ import annotations

from pathlib import Path

import torch

from specgate.decoding.config import EngineConfig
from specgate.decoding.target import Target

# torch's own setting (OMP_NUM_THREADS, else one per core), read before a llama.cpp target sets one
TORCH_THREADS = torch.get_num_threads()


def load_target(cfg: EngineConfig, model: Path, num_slots: int, tree_nodes: int = 0, exact: bool = False) -> Target:
    """`model` on cfg's backend with `num_slots` sequences; `tree_nodes` > 0 lets it verify draft trees.
    `exact`: llama.cpp's batch-invariant mode (the served targets take cfg.exact; a draft model's
    tokens are only proposals, so it never needs it). The fp32 PyTorch engine is exact as it is."""
    if cfg.backend == "llamacpp":
        from specgate.decoding.llamacpp_target import LlamaCppTarget

        # llama.cpp's own thread pool owns the cores. A second OpenMP team (torch's: sampling, the
        # EAGLE head) made every llama.cpp decode after it slower: sampled decoding ran 11.5 ms a
        # token against 7.0 greedy in one process with torch at 2 threads, 8.3 against 8.0 at 1
        # (docs/engines.md, "Threads"). Servers set OMP_NUM_THREADS=1 already; this holds everywhere.
        torch.set_num_threads(1)
        return LlamaCppTarget(model, cfg.max_context, num_slots, cfg.threads, tree_nodes, exact=exact)
    from specgate.decoding.torch_target import TorchTarget

    torch.set_num_threads(cfg.num_threads or TORCH_THREADS)
    return TorchTarget.load(model, cfg.torch_dtype, cfg.max_context, num_slots)
