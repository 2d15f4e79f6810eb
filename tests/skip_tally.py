"""A pytest plugin for `pytest --collect-only -p skip_tally`: one line per collected test with what
would skip it, so the README's skip counts can be counted without running the suite
(tests/test_snippets.py). A line: "SKIP-TALLY <node id> <TAB> gpu marker 0/1 <TAB> every skipif
reason of the test, '|'-joined <TAB> the reason a skipif gives here and now, or ''"."""
from _pytest.skipping import evaluate_skip_marks


def pytest_collection_finish(session):
    for item in session.items:
        reasons = [m.kwargs.get("reason", "") for m in item.iter_markers("skipif")]
        now = evaluate_skip_marks(item)
        print("SKIP-TALLY " + "\t".join([
            item.nodeid, str(int(item.get_closest_marker("gpu") is not None)),
            "|".join(r.replace("\t", " ").replace("|", "/") for r in reasons),
            now.reason if now is not None else ""]))
