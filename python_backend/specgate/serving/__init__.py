"""Triton Python-backend adapters. Each `model_repository/<model>/1/model.py` re-exports one class."""
