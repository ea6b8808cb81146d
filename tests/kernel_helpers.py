"""Loading the Triton kernels for tests: interpreted on a CPU machine, compiled on a GPU one.

Triton reads TRITON_INTERPRET when ``@triton.jit`` decorates a kernel (when ``rocketkv_mt.kernels`` is
first imported). On a machine without CUDA the kernels must be interpreted; ``load_kernels`` rebuilds
them so if another module imported them before the variable was set. On a GPU machine,
``TRITON_INTERPRET=0`` runs them on CUDA (``make gpu-check`` does).
"""
import importlib
import os
import sys

import torch


def load_kernels():
    """The kernels package, or None when they cannot run here (built for a GPU, but no CUDA)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    kernels = importlib.import_module("rocketkv_mt.kernels")
    if not kernels.INTERPRETED and not torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] == "1":
        # Another module imported the kernels before TRITON_INTERPRET was set: rebuild them interpreted.
        for name in [m for m in sys.modules if m.startswith("rocketkv_mt.kernels")]:
            del sys.modules[name]
        kernels = importlib.import_module("rocketkv_mt.kernels")
    if not kernels.INTERPRETED and not torch.cuda.is_available():
        return None
    return kernels


def kernel_device(kernels) -> str:
    return "cpu" if kernels.INTERPRETED else "cuda"
