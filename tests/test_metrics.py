"""Training metrics measured in the training process (trainer/metrics.py)."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO


def test_a_training_process_reports_its_own_peak_rss_not_its_parents():
    """trainer.metrics.peak_rss_mb is VmHWM: a process started by one that holds 800 MB reports its own peak, where
    ru_maxrss would report the parent's (Linux keeps the high-water mark across fork and exec)."""
    held = bytearray(800 * 2**20)
    for i in range(0, len(held), 4096):
        held[i] = 1
    code = ("import json, resource; from trainer.metrics import peak_rss_mb; print(json.dumps([peak_rss_mb(), "
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(REPO)).stdout
    own, inherited = json.loads(out.strip().splitlines()[-1])
    assert inherited > 800  # what the training stages reported before
    assert own < 700  # python with torch and transformers imported, well below the parent's 800 MB
    del held
