"""Check the services a run needs before any stage runs, each within a bounded time.

An unreachable tracking server made MLflow retry for minutes behind urllib3 warnings; an S3 endpoint that was
down or refused the credentials surfaced as a raw traceback from planning. Here each service gets one quick probe,
and a failure becomes one line that names the URL and the setting or environment variable to fix:

- tracking: `tracking:` / MLFLOW_TRACKING_URI: an http(s) server answers, or a sqlite file's folder is writable;
- store: `store:` / AWS_ENDPOINT_URL / AWS_*: the endpoint answers, the credentials are accepted, the bucket
  exists; a local store folder is writable;
- Prefect: PREFECT_API_URL, when set, answers.
"""
from __future__ import annotations

import os
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from lmforge.errors import LmforgeError

TIMEOUT_SECONDS = float(os.environ.get("LMFORGE_PREFLIGHT_TIMEOUT_SECONDS", "10"))


class ServiceError(LmforgeError):
    """A service the run needs is unreachable or refuses it; the message names the setting to fix."""

    retryable = False


def check_all(store_url: str, tracking_uri: str) -> None:
    """Raise ServiceError naming every service that failed its probe."""
    problems = [p for p in (check_tracking(tracking_uri), check_store(store_url), check_prefect()) if p]
    if problems:
        raise ServiceError("\n".join(problems))


def _http_ok(url: str) -> str | None:
    """None if `url` answers at all (any HTTP status), else why not."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_SECONDS):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason


def check_tracking(uri: str) -> str | None:
    if uri.startswith(("http://", "https://")):
        why = _http_ok(uri.rstrip("/") + "/health")
        if why:
            return (f"tracking server {uri} is unreachable ({why}); start it, or set `tracking:` in the config or "
                    "MLFLOW_TRACKING_URI to a reachable server or a sqlite file (sqlite:///mlflow.db)")
    elif uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).parent
        why = _writable(folder)
        if why:
            return f"tracking database folder {folder} is not writable ({why}); set `tracking:` or MLFLOW_TRACKING_URI"
    return None


def _writable(folder: Path) -> str | None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".lmforge-write-check-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def check_store(url: str) -> str | None:
    from lmforge.store import filesystem, is_local

    try:
        fs, root = filesystem(url)
    except Exception as e:  # noqa: BLE001  an unknown protocol, a missing fsspec backend
        return f"store {url}: {type(e).__name__}: {e}; set `store:` to a local folder or s3://bucket/prefix"
    if is_local(fs):
        why = _writable(Path(root))
        return f"store folder {root} is not writable ({why}); set `store:` to a folder you can write" if why else None
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the AWS default"
    bucket = root.split("/", 1)[0]
    if fs.protocol and "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        fs = type(fs)(skip_instance_cache=True, config_kwargs={"connect_timeout": TIMEOUT_SECONDS,
                                                              "read_timeout": TIMEOUT_SECONDS,
                                                              "retries": {"max_attempts": 1}},
                      **({"client_kwargs": {"endpoint_url": endpoint}} if endpoint != "the AWS default" else {}))
    t0 = time.monotonic()
    try:
        fs.ls(bucket, detail=False)
        return None
    except FileNotFoundError:
        return (f"store {url}: bucket {bucket!r} does not exist at {endpoint}; create it, or set `store:` to an "
                "existing bucket")
    except PermissionError as e:
        return (f"store {url}: {endpoint} refused the credentials ({str(e).splitlines()[0]}); check "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
    except Exception as e:  # noqa: BLE001  botocore's connection errors and the like
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "credential" in text.lower() or "signature" in text.lower() or "accessdenied" in text.lower():
            return (f"store {url}: {endpoint} refused the credentials ({text}); check AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY")
        return (f"store {url}: the S3 endpoint {endpoint} is unreachable after {time.monotonic() - t0:.0f} s "
                f"({type(e).__name__}: {text}); check AWS_ENDPOINT_URL, or set `store:` to a local folder")


def check_prefect() -> str | None:
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        return None  # Prefect's ephemeral API starts with the run
    why = _http_ok(url.rstrip("/") + "/health")
    if why:
        return (f"Prefect API {url} is unreachable ({why}); start the server (prefect server start) or unset "
                "PREFECT_API_URL to use a temporary one")
    return None
