"""CPU reference engine: Llama forward with a slotted KV cache, sampling, and the batching runner."""
