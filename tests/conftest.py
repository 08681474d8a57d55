import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def single_thread():
    """One OpenMP thread for the test: with tiny shapes a second thread only waits at barriers,
    which makes small ops 10-20x slower on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
