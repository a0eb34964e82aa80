"""Speculative decoding engine core: drafters (one module per algorithm), verification, the loop."""

from specgate.speculative.drafter import Drafter, DraftTree
from specgate.speculative.generator import SpecStream, SpeculativeGenerator
from specgate.speculative.registry import ALGORITHMS, build_drafters
from specgate.stats import SpecStats

__all__ = ["ALGORITHMS", "DraftTree", "Drafter", "SpecStats", "SpecStream", "SpeculativeGenerator", "build_drafters"]
