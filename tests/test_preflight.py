"""Services that are down or refuse the run: `lmforge run` exits 2 within 30 s with one line naming the URL and the
setting or environment variable to fix, before any stage runs. (Without these checks an unreachable tracking server
hangs for minutes printing only urllib3 warnings, and a down S3 endpoint or bad credentials give a raw traceback
from planning.)"""
from __future__ import annotations

import time

import pytest
import s3fs

from flows.cli import main
from tests.helpers import basic_config, write_config


def _run(tmp_path, capsys, **top) -> tuple[int, float, str]:
    raw = basic_config(tmp_path)
    raw.update(top)
    cfg = write_config(tmp_path, raw)
    t0 = time.monotonic()
    rc = main(["run", str(cfg)])
    return rc, time.monotonic() - t0, capsys.readouterr().err


def test_unreachable_tracking_server(tmp_path, capsys):
    rc, seconds, err = _run(tmp_path, capsys, tracking="http://127.0.0.1:9")
    assert rc == 2 and seconds < 30, (rc, seconds, err)
    assert "tracking server http://127.0.0.1:9 is unreachable" in err
    assert "`tracking:`" in err and "MLFLOW_TRACKING_URI" in err
    assert not (tmp_path / "artifacts").exists() or not any((tmp_path / "artifacts").iterdir())  # nothing ran


def test_unreachable_prefect_api(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    rc, seconds, err = _run(tmp_path, capsys)
    assert rc == 2 and seconds < 30, (rc, seconds, err)
    assert "Prefect API http://127.0.0.1:9/api is unreachable" in err and "PREFECT_API_URL" in err


def test_s3_endpoint_down(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    s3fs.S3FileSystem.clear_instance_cache()
    rc, seconds, err = _run(tmp_path, capsys, store="s3://lmforge-test/down")
    assert rc == 2 and seconds < 30, (rc, seconds, err)
    assert "the S3 endpoint http://127.0.0.1:9 is unreachable" in err and "AWS_ENDPOINT_URL" in err
    assert "Traceback" not in err


@pytest.mark.s3
def test_s3_wrong_credentials_and_missing_bucket(s3, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    s3fs.S3FileSystem.clear_instance_cache()
    rc, seconds, err = _run(tmp_path, capsys, store="s3://lmforge-test/creds")
    assert rc == 2 and seconds < 30, (rc, seconds, err)
    assert "refused the credentials" in err and "AWS_ACCESS_KEY_ID" in err and "not-the-secret" not in err
    monkeypatch.undo()
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    rc, seconds, err = _run(tmp_path, capsys, store="s3://no-such-bucket/x")
    assert rc == 2 and "bucket 'no-such-bucket' does not exist" in err, err


def test_an_ephemeral_prefect_server_that_does_not_start_in_time_says_what_to_do(tmp_path):
    """Under load Prefect's temporary API server can miss its default 20 s start-up window, with a bare
    RuntimeError. lmforge gives it 180 s, and when even that is not enough the message says what to set or start.
    Forced here with a 0 s window, in a CLI process of its own (the test session's server is already up)."""
    import os
    import subprocess
    import sys

    import psutil

    from tests.helpers import REPO

    cfg = write_config(tmp_path, basic_config(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "0",
           "PREFECT_HOME": str(tmp_path / "prefect")}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(cfg)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    family: dict[int, psutil.Process] = {}
    while proc.poll() is None:
        try:
            family.update({p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)})
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert "Prefect's temporary API server did not start (Prefect: Timed out while attempting to connect" in err
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (now 0 s)" in err  # the window Prefect used
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in err and "PREFECT_API_URL=" in err
    assert "prefect server start --host 127.0.0.1" in err
    _, alive = psutil.wait_procs(list(family.values()), timeout=15)
    assert alive == [], [(p.pid, p.cmdline()) for p in alive]  # the server that was starting is not left behind
    assert not (tmp_path / "artifacts" / "ingest").exists()  # no stage ran


def test_the_cli_gives_prefects_temporary_server_180_s_to_start():
    """Prefect reads its settings when first imported: a default set after that import leaves Prefect at its 20 s,
    which runs under load overshoot. Imported in the CLI's order."""
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    probe = ("import flows.cli\nfrom prefect.exceptions import CancelledRun\nimport flows.pipeline\n"
             "from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as s\nprint(s.value())")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-1] == "180", out.stderr[-2000:]
