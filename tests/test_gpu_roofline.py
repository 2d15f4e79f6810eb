"""benchmarks/gpu_roofline.py's arithmetic on the CPU (the measuring needs a GPU)."""
import importlib.util
import pathlib

import pytest

spec = importlib.util.spec_from_file_location(
    "gpu_roofline", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_roofline.py")
roof = importlib.util.module_from_spec(spec)
spec.loader.exec_module(roof)


def test_hbm_limit_counts_every_input_read_and_output_written():
    # world 2, 256 MiB per rank, 2.9 TB/s: 4 x 256 MiB at 2.9e12 B/s = 370 us (DESIGN.md's figure)
    assert roof.hbm_limit_us(2, 256 << 20, 2900) == pytest.approx(370.2, abs=0.1)


def test_bench_json_rows_in_place_all_reduce_only():
    doc = {"runs": [{"peak_membw_GBps": 2800.0, "rows": [
        {"collective": "all_reduce", "inplace": True, "size_bytes": 4096, "time_us": 20.0, "wrong": 0},
        {"collective": "all_reduce", "inplace": False, "size_bytes": 4096, "time_us": 25.0, "wrong": 0},
        {"collective": "all_gather", "inplace": True, "size_bytes": 4096, "time_us": 9.0, "wrong": 0},
        {"collective": "all_reduce", "inplace": True, "size_bytes": 8192, "time_us": 30.0, "wrong": 3},
    ]}]}
    times, bw = roof.bench_times(doc)
    assert times == {4096: 20.0} and bw == 2800.0  # a row with wrong results is not a time


def test_table_fraction_and_ratio():
    s = 256 << 20
    results = {("on", 2, "auto"): {s: 740.4}, ("off", 2, "auto"): {s: 2221.2},
               ("on", 2, "oneshot"): {s: 17031.5}}
    text = roof.table(results, 2900, [s])
    rows = [line for line in text.splitlines() if line.startswith("| 2 |")]
    assert rows[0] == "| 2 | 256 MiB | auto | 740.4 | 0.50 | 2,221.2 | 3.0x |", rows
    assert rows[1] == "| 2 | 256 MiB | oneshot | 17,031.5 | 0.02 | - | - |", rows


@pytest.mark.parametrize("text,value", [("4K", 4096), ("256M", 256 << 20), ("1MiB", 1 << 20), ("100", 100)])
def test_sizes(text, value):
    assert roof.parse_size(text) == value
