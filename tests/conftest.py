import sys

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles as it would in a process of its own. Dynamo remembers, per function,
    the shapes it compiled it for: a test compiling a block that an earlier test of the same
    worker had compiled at other shapes traced it again with symbolic shapes (automatic dynamic
    shapes), e.g. the large family's checkpointing-and-compile test took 16 s instead of 5 after
    the FSDP export test; and a function's recompile limit could be reached, after which it runs
    eagerly. Dynamo itself is not imported here (2-3 s) for tests that do not use it."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
    yield


@pytest.fixture
def single_thread():
    """One OpenMP thread for the test: with tiny shapes a second thread only waits at barriers,
    which makes small ops 10-20x slower on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    """Tests marked `interpret` run Triton kernels on CPU tensors, which only the interpreter
    does: without TRITON_INTERPRET=1 (a GPU machine) they are skipped, and the `gpu` tests of
    the same modules run."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1 (on a GPU: -m gpu)")
    for item in items:
        if item.get_closest_marker("interpret") and not item.get_closest_marker("gpu"):
            item.add_marker(skip)
