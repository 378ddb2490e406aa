"""`lmforge` sends no usage reports: Prefect's ephemeral server, which every `lmforge run` starts, reports telemetry
to the network unless told not to, and the README's commands do not go through the Makefile (which exports the same
settings). The CLI sets them unless the user did."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

PROBE = ("import json, flows.cli; from prefect.settings import get_current_settings; "
         "print(json.dumps([get_current_settings().server.analytics_enabled, __import__('os').environ['DO_NOT_TRACK']]))")


def _probe(**env: str) -> list:
    clean = {k: v for k, v in os.environ.items() if k not in ("DO_NOT_TRACK", "PREFECT_SERVER_ANALYTICS_ENABLED")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, "PYTHONPATH": str(REPO), **env}, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_cli_turns_telemetry_off_unless_the_user_chose():
    assert _probe() == [False, "1"]
    assert _probe(PREFECT_SERVER_ANALYTICS_ENABLED="true", DO_NOT_TRACK="0") == [True, "0"]
