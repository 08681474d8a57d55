import importlib.util
import os

import torch

# Kernel tests need CUDA or the interpreter; the configuration test only needs Triton installed.
KERNEL_TESTS = ["test_gates.py", "test_states.py", "test_output.py", "test_dstates.py", "test_custom_ops.py"]
if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]
elif not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
    collect_ignore = KERNEL_TESTS
