import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)
