"""`lmforge` sends no usage reports: Prefect's ephemeral server, which every `lmforge run` starts, reports telemetry
to the network unless told not to, and the README's commands do not go through the Makefile (which exports the same
settings). The CLI sets them unless the user did."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import REPO

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


def test_lmforge_run_starts_prefects_server_with_analytics_off(tmp_path):
    """Where it matters: `lmforge run` (no setting of the user's) starts Prefect's ephemeral API server as a child
    process, and that server, the part that reports usage, runs with analytics off and DO_NOT_TRACK set."""
    import psutil

    from tests.helpers import basic_config, write_config

    cfg = write_config(tmp_path, basic_config(tmp_path))
    clean = {k: v for k, v in os.environ.items() if k not in ("DO_NOT_TRACK", "PREFECT_SERVER_ANALYTICS_ENABLED")}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(cfg)], cwd=tmp_path,
                            env={**clean, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    server_env = None
    try:
        while server_env is None and proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if "prefect.server.api.server:create_app" in " ".join(child.cmdline()):
                        server_env = child.environ()
                except psutil.NoSuchProcess:
                    continue
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert server_env is not None, "no Prefect server process seen under lmforge run"
    # Prefect passes its settings on as it prints them ("False")
    assert (server_env.get("PREFECT_SERVER_ANALYTICS_ENABLED", "").lower(), server_env.get("DO_NOT_TRACK")) == \
        ("false", "1")
    assert "telemetry" not in out.lower(), out[-3000:]
