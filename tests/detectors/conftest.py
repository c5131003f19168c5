import pytest

from faultbench.harness.launch import RankPool


@pytest.fixture(scope="session")
def suite_pool():
    """One 2-rank pool for the data-parallel suite cases of this worker."""
    with RankPool(2) as pool:
        yield pool
