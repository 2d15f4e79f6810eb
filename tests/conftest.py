"""Fixtures shared by the test files. tests/ is on sys.path (pytest's rootdir insertion), so the
ranks that dist_utils spawns can import these helpers too."""
import os

import pytest

SHM_PREFIX = "ringreduce-"  # every segment and pool buffer ringreduce creates (ringreduce/_comm.py)


def shm_entries():
    """ringreduce's names in /dev/shm, sorted."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX))


@pytest.fixture
def no_shm_leak():
    """Fails the test if it leaves a ringreduce segment in /dev/shm. A file opts in with
    `pytestmark = pytest.mark.usefixtures("no_shm_leak")`."""
    before = shm_entries()
    yield
    left = sorted(set(shm_entries()) - set(before))
    assert shm_entries() == before, f"shared-memory segments left in /dev/shm: {left}"
