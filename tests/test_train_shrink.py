"""examples/train_ddp.py --on-failure shrink across three simulated hosts (issue 84 item 3): one
host is lost whole mid-epoch (its torchrun agent and both workers SIGKILLed), and the other two hosts'
ranks shrink the group and finish the job at world 4 without a restart. The launcher is
benchmarks/train_failover.py (which also times it against the elastic restart)."""
import importlib.util
import os
import re
import shutil

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "train_failover", os.path.join(REPO, "benchmarks", "train_failover.py"))
failover = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(failover)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="simulated hosts need root and unshare")
def test_host_lost_survivors_shrink_and_finish(tmp_path):
    # 1437 images / 6 ranks / 8 per batch: 30 steps an epoch. Host 2 dies in step 20 (epoch 0,
    # 19 batches = 152 samples of each 6-rank share done): 912 samples of the epoch's permutation,
    # 228 of each 4-rank share, so the survivors redo it as step 29 (45 steps an epoch at world 4).
    run = failover.launch(str(tmp_path), "shrink", epochs=2, die_step=20)
    outs = run["outs"]
    for h, out in enumerate(outs):  # for a look when it fails (kept with the session's temp dir)
        (tmp_path / f"host{h}.out").write_text(out)
    assert run["stray"] == [], f"processes left behind: {run['stray']}"
    dead, survivors = outs[2], outs[0] + outs[1]
    assert re.search(r"^rank 5 restart 0 dying at step 20 ", dead, re.M), dead[-3000:]
    assert run["rcs"][2] != 0
    shrunk = re.findall(r"^rank (\d) restart (\d+) shrunk at step 20 time [0-9.]+ "
                        r"\(lost \[4, 5\]; now rank (\d) of 4\)$", survivors, re.M)
    assert sorted(shrunk) == [(str(r), "0", str(r)) for r in range(4)], survivors[-4000:]
    first = failover.times(survivors, "first step after shrink 29 done")
    assert sorted(first) == [0, 1, 2, 3], survivors[-4000:]
    # no restart: every event line is attempt 0 (TORCHELASTIC_RESTART_COUNT stays 0)
    attempts = set(re.findall(r"^rank \d restart (\d+) ", survivors, re.M))
    assert attempts == {"0"}, attempts
    for e in (1, 2):
        assert re.search(rf"^epoch {e}/2 .*\(359 test images, 4 ranks, backend ringreduce",
                         survivors, re.M), survivors[-4000:]
    found = dict(re.findall(r"^rank (\d) host host[01] parameters sha1 ([0-9a-f]{40})$", survivors,
                            re.M))
    assert sorted(found) == ["0", "1", "2", "3"] and len(set(found.values())) == 1, found
    # Each surviving agent saw all its workers exit 0, then waited in its exit barrier for the
    # lost host's agent until we stopped it.
    for h in (0, 1):
        assert failover.FINISHED in outs[h] and run["stopped"][h], outs[h][-4000:]
    assert run["leftovers"][:2] == [[], []], run["leftovers"]
    saved = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert (saved["world_size"], saved["epoch"], saved["step"]) == (4, 2, 90)
    assert saved["scheduler"]["last_epoch"] == 90
    seconds = failover.kill_to_next_step(run, "shrink")
    print(f"host lost: the first step after the shrink came {seconds:.2f} s after the kill")
