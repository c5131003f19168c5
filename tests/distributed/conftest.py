import pytest

from faultbench.harness.launch import RankPool


@pytest.fixture(scope="session")
def pool():
    """One 2-rank pool for the whole session: its process group is reused by every case."""
    with RankPool(2) as p:
        yield p


def pytest_collection_modifyitems(items):
    # keep every distributed test on one xdist worker, so they share the pool and do not oversubscribe
    for item in items:
        if "tests/distributed/" in str(item.fspath):
            item.add_marker(pytest.mark.xdist_group("distributed"))
