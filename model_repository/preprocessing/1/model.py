"""Triton model `preprocessing`: a thin adapter; the logic lives in specgate.serving.preprocessing_model."""

import os
import sys

# The Python backend's embedded interpreter ignores PYTHONPATH; the launcher passes the venv here.
sys.path[:0] = [p for p in os.environ.get("SPECGATE_PYTHONPATH", "").split(os.pathsep) if p]

from specgate.serving.preprocessing_model import PreprocessingModel as TritonPythonModel  # noqa: E402,F401
