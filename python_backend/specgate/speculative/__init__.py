"""Speculative decoding engine core: drafters (one module per algorithm), verification, the loop."""

from specgate.speculative.drafter import Drafter
from specgate.speculative.generator import SpecStream, SpeculativeGenerator
from specgate.stats import SpecStats

__all__ = ["Drafter", "SpecStats", "SpecStream", "SpeculativeGenerator"]
