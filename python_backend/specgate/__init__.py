"""Speculative decoding behind Triton: engines, drafters, gate."""
