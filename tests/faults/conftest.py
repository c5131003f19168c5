import pytest

from faultbench.harness.launch import RankPool


@pytest.fixture(scope="session")
def clean_cache() -> dict:
    """Clean outcomes per (scenario, variant, steps, seed), shared by the faults of one worker."""
    return {}


@pytest.fixture(scope="session")
def fault_pool():
    with RankPool(2) as pool:
        yield pool
