import pytest


@pytest.fixture(autouse=True)
def _single_thread(single_thread):  # every test here has tiny shapes (see tests/conftest.py)
    yield
