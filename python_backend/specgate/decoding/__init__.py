"""Decoding: the targets (llama.cpp, PyTorch) behind one interface, sampling, and the batching runner.

"Engine" means the Triton engine models (`target_engine`, `spec_engine`, serving/engine_model.py);
this package is what they decode with.
"""
