"""Fixtures shared by the test files. tests/ is on sys.path (pytest's rootdir insertion), so the
ranks that dist_utils spawns can import these helpers too."""
import os
import shutil
import tempfile

import pytest

# One temp folder for everything the tests and the processes they start leave behind (ranks'
# stderr and results, simulated hosts' jobs, torchrun's logs, flight recorder dumps, compile
# caches): set before any test starts a process, removed when the session passes, kept (and named)
# when it fails.
SESSION_TMP = tempfile.mkdtemp(prefix="rr-pytest-")
os.environ["TMPDIR"] = SESSION_TMP
tempfile.tempdir = SESSION_TMP
# The CPU ring's automatic choice as the code's defaults, not as the measured table's entry for
# the machine the tests happen to run on (ringreduce/cpu_tuning.json); the table's tests set their own.
os.environ["RINGREDUCE_CPU_TUNING"] = "none"
# Nor calibrated on it (ringreduce/_calibrate.py); the calibration's tests set their own.
os.environ["RINGREDUCE_CALIBRATE"] = "off"


def pytest_report_header(config):
    return f"temp dir of this session: {SESSION_TMP} (removed if every test passes)"


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0:
        shutil.rmtree(SESSION_TMP, ignore_errors=True)
    else:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"temp dir of this session kept for a look: {SESSION_TMP}")

SHM_PREFIX = "ringreduce-"  # every segment and pool buffer ringreduce creates (ringreduce/_shm.py)


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
