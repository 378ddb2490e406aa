"""One builder per artifact: a lease in the store, with a heartbeat and an expiry.

Two `lmforge run` of the same config (or two pipelines sharing a stage) must not build the same artifact at once:
they would train twice into one `_checkpoints/` and prune each other's files. Before a stage runs, its run takes
`{store}/{kind}/{id}/_lease.json`. Another run that needs the same artifact waits, logging who holds the lease
(run, host, pid, since when), and uses the result once its manifest appears. The holder renews the lease every
`ttl/4`; a holder that was SIGKILLed stops renewing, and after `ttl` a waiter takes the lease over and resumes from
the checkpoints (at once when the holder ran on this host and its process is gone). A holder that lost its lease (it stalled past the expiry and someone took over) must not publish:
`check()` before publishing raises `LeaseLost` (fencing).

Creating the lease is exclusive: `O_CREAT|O_EXCL` on a local store; on S3 a conditional PUT (`If-None-Match: *`,
honoured by AWS S3 since 2024 and by SeaweedFS), followed by a read-back that confirms the owner, so a server that
ignored the condition still leaves only one winner in all but a race inside one round trip. Taking over an
expired lease deletes it and creates it again through the same exclusive path.

A stage trained on several nodes (`nnodes` > 1) has one builder: the `lmforge run` that holds the lease is node 0.
The other nodes (`lmforge join`, trainer/launch.py) never take the lease and never publish or upload: they follow
node 0's job spec while `Fence.live()` says node 0 still holds the lease, and give up when it does not.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import threading
import time
import uuid
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from lmforge.errors import LmforgeError
from lmforge.owner import process_gone, process_started

log = logging.getLogger(__name__)

LEASE = "_lease.json"
TTL_SECONDS = float(os.environ.get("LMFORGE_LEASE_SECONDS", "120"))
POLL_SECONDS = float(os.environ.get("LMFORGE_LEASE_POLL_SECONDS", "2"))


class LeaseLost(LmforgeError):
    """This run's lease on an artifact expired and another run took it over: it must not publish."""


def _holder_is_gone(held: dict[str, Any]) -> bool:
    """A holder on this host whose process no longer exists (kill -9) need not be waited for until its expiry."""
    if held.get("host") != platform.node() or not isinstance(held.get("pid"), int):
        return False
    return process_gone(held["pid"], held.get("pid_started"))


class Lease:
    def __init__(self, store, kind: str, aid: str, run: str, ttl: float | None = None):
        self.store, self.kind, self.aid, self.run = store, kind, aid, run
        self.ttl = ttl or TTL_SECONDS
        self.path = f"{store.artifact_path(kind, aid)}/{LEASE}"
        self.owner = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False
        self.took_over: dict[str, Any] | None = None  # the stale holder's record, when acquire took the lease over

    # ---- the record
    def _record(self) -> dict[str, Any]:
        now = time.time()
        return {"owner": self.owner, "run": self.run, "host": platform.node(), "pid": os.getpid(),
                "pid_started": process_started(os.getpid()),
                "since": getattr(self, "_since", now), "heartbeat": now, "expires": now + self.ttl}

    def read(self) -> dict[str, Any] | None:
        fs = self.store.fs
        try:
            fs.invalidate_cache(self.path)
            return json.loads(fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, ValueError):  # half-written by a crash mid-write: treat as expired
            return {"owner": "?", "expires": 0}

    def _create_exclusive(self) -> bool:
        data = json.dumps(self._record()).encode()
        fs = self.store.fs
        fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        if self.store.local:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
        try:
            fs.pipe_file(self.path, data, IfNoneMatch="*")
        except OSError as e:  # 412 Precondition Failed: someone has it (s3fs raises it as an OSError)
            text = f"{e!r} {e.__cause__!r}".lower().replace("-", "")
            if isinstance(e, FileExistsError) or "412" in text or "precondition" in text:
                return False
            raise
        got = self.read()  # a server that ignored the condition: the last writer wins; confirm it is us
        return bool(got) and got.get("owner") == self.owner

    # ---- taking, keeping, giving back
    def acquire(self, done: Callable[[], bool]) -> bool:
        """Take the lease, waiting while another live run holds it. Returns False (without the lease) when `done()`
        says the artifact was published meanwhile."""
        waited_log = 0.0
        while True:
            if done():
                return False
            self._since = time.time()
            if self._create_exclusive():
                break
            held = self.read()
            if held is None:
                continue  # released between our attempt and the read: try again
            dead = _holder_is_gone(held)
            if dead or time.time() > float(held.get("expires", 0)):
                why = "its process is gone" if dead else \
                    f"it expired {time.time() - float(held.get('expires', 0)):.0f} s ago"
                log.warning("%s/%s: the lease of run %s (host %s, pid %s) is stale: %s; taking over (its "
                            "checkpoints are kept and resumed)", self.kind, self.aid, held.get("run"), held.get("host"),
                            held.get("pid"), why)
                self._delete_if(held.get("owner"))
                self.took_over = held
                continue
            if time.monotonic() - waited_log > 30:
                since = time.strftime("%H:%M:%S", time.localtime(float(held.get("since", 0))))
                log.info("%s/%s is being built by run %s (host %s, pid %s, since %s); waiting for it", self.kind,
                         self.aid, held.get("run"), held.get("host"), held.get("pid"), since)
                waited_log = time.monotonic()
            time.sleep(POLL_SECONDS)
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease-{self.kind}-{self.aid}", daemon=True)
        self._thread.start()
        return True

    def _delete_if(self, owner: str | None) -> None:
        held = self.read()
        if held is not None and held.get("owner") == owner:
            try:
                self.store.fs.rm_file(self.path)
            except FileNotFoundError:
                pass

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            held = self.read()
            if held is None or held.get("owner") != self.owner:
                self.lost = True
                log.error("%s/%s: this run lost its lease (now held by run %s); it will not publish", self.kind,
                          self.aid, (held or {}).get("run"))
                return
            self.store._write_json(self.path, self._record())

    def check(self) -> None:
        """Fencing: raise LeaseLost unless this run still holds the lease."""
        held = self.read()
        if self.lost or held is None or held.get("owner") != self.owner:
            self.lost = True
            raise LeaseLost(f"{self.kind}/{self.aid}: this run's lease expired and run {(held or {}).get('run')} "
                            "took the artifact over; not publishing (the other run builds it)")

    def fence(self) -> "Fence":
        """What a training child needs to check that this run still holds the lease before it writes or prunes
        checkpoints."""
        return Fence(uri=self.store.artifact_uri(self.kind, self.aid) + "/" + LEASE, owner=self.owner)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if not self.lost:
            self._delete_if(self.owner)


class Fence(BaseModel):
    """A lease as a training child sees it: the lease file's URL and the owner this run wrote into it. The child
    checks it before every checkpoint upload and prune, so a run whose lease was taken over (it stalled past the
    expiry) cannot overwrite or prune the checkpoints of the run that now holds it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    uri: str
    owner: str

    def held(self) -> dict[str, Any] | None:
        """The lease record in the store now ({} when unreadable, None when there is none)."""
        from lmforge.store import filesystem

        fs, path = filesystem(self.uri)
        try:
            fs.invalidate_cache(path)
            return json.loads(fs.cat_file(path))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, ValueError):
            return {}

    def live(self) -> tuple[bool, str]:
        """(does the run that wrote this fence still hold the lease, and if not why): it holds it, it has not expired
        and, on this host, its process still exists. What a joining node checks while it follows node 0."""
        held = self.held()
        if not held or held.get("owner") != self.owner:
            return False, ("the lease was released" if held is None else
                           f"the lease is now held by run {held.get('run')}")
        if time.time() > float(held.get("expires", 0)):
            return False, f"the lease of run {held.get('run')} expired (no heartbeat since " \
                          f"{time.strftime('%H:%M:%S', time.localtime(float(held.get('heartbeat', 0))))})"
        if _holder_is_gone(held):
            return False, f"the process of run {held.get('run')} (pid {held.get('pid')}) is gone"
        return True, f"run {held.get('run')} (host {held.get('host')}, pid {held.get('pid')}) holds the lease"

    def check(self, what: str) -> None:
        held = self.held()
        if not held or held.get("owner") != self.owner:
            raise LeaseLost(f"{what}: this run no longer holds the lease {self.uri} (now "
                            f"{'held by run ' + str(held.get('run')) if held else 'released'}); it does not touch the "
                            "checkpoints, which belong to the holder")
