import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    # Tiny shapes: one thread is faster, and on a shared 2-core machine a second OpenMP thread
    # waiting at barriers makes small ops 10-20x slower.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
