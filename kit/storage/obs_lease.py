"""One writer per OBS prefix: a lease object taken with a conditional put, renewed while its writer works, checked
again (read from OBS) before the writer publishes (a listing, a complete marker) and deleted after.

Object stores have no lock; a put with `If-None-Match: *` creates an object only where none exists (S3 and the
SeaweedFS the tests run answer 412 otherwise). The lease is `<prefix>/.kit-writer-<generation>.json` (holder, token,
until) and the highest generation holds. An expired lease is taken over by creating the next generation the same
way, so of two writers that find the same stale lease exactly one gets it. Every created lease is read back, so where
a server ignores the condition the check before publishing still lets only the last writer publish.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Callable, Optional, Tuple

from kit.errors import KitError
from kit.storage.locks import LockedError, identity
from kit.system.waits import seconds

NAME = ".kit-writer-"  # <prefix>/.kit-writer-<generation, 8 digits>.json
# a lease lasts this long unless its writer renews it (every quarter of it): how long a killed writer blocks the prefix
LEASE_VARIABLE, LEASE_S = "KIT_OBS_LEASE_S", 120.0


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _holder(body: dict) -> str:
    return f"PID {body.get('pid')} on {body.get('host')} ({body.get('what') or 'unknown'})"


class Lease:
    """The writer lease of `prefix` in `store` for `what` ("obs push", "training run"): take() (renewed in a thread
    from then on), check() before publishing, release() after. `key`/`token`: a lease taken by another process."""

    def __init__(self, store, prefix: str, what: str, key: Optional[str] = None, token: Optional[str] = None):
        self.store, self.prefix, self.what = store, prefix, what
        self.url = f"obs://{store.bucket}/{prefix}"
        self.key, self.token = key, token or os.urandom(8).hex()
        self.term = seconds(os.environ, LEASE_VARIABLE, LEASE_S)
        self.lost: Optional[str] = None  # set by the renewal when another writer holds the lease
        self._stop, self._lock = threading.Event(), threading.Lock()

    def ref(self) -> dict:
        """What another process needs to check() this lease (the uploader child)."""
        return {"key": self.key, "token": self.token}

    def _body(self) -> bytes:
        me = identity()
        body = {"host": me["host"], "pid": me["pid"], "what": self.what, "token": self.token}
        return json.dumps(dict(body, until=time.time() + self.term)).encode()

    def _current(self) -> Tuple[int, Optional[str], dict]:
        """(generation, key, content) of the lease that holds, or (highest generation seen, None, {})."""
        base = f"{self.prefix}/{NAME}"
        gens = {}
        for key in self.store.list(base):
            num = key[len(base) :].rsplit(".json", 1)[0]
            if key.endswith(".json") and num.isdigit():
                gens[int(num)] = key
        top = max(gens, default=0)
        for gen in sorted(gens, reverse=True):
            raw = self.store.get_bytes(gens[gen])
            if raw is not None:  # else released since the listing
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = {}
                return gen, gens[gen], body if isinstance(body, dict) else {}
        return top, None, {}

    def take(self, wait_s: float = 0.0, note: Optional[Callable[[str], None]] = None) -> Lease:
        """Take the lease (waiting up to `wait_s` for another writer's to end or expire); LockedError if held."""
        deadline, noted = time.monotonic() + wait_s, False
        for _ in range(1000):
            gen, key, body = self._current()
            until = body.get("until", 0) if isinstance(body.get("until"), (int, float)) else 0
            if key is not None and until > time.time():
                if time.monotonic() >= deadline:
                    raise LockedError(
                        f"{self.url} is being written by {_holder(body)}, whose writer lease lasts until "
                        f"{_utc(until)} (renewed while it writes): wait for it to finish, or run this again "
                        f"after that time if it has stopped, or choose another OBS folder."
                    )
                if note and not noted:
                    noted = True
                    note(
                        f"waiting up to {wait_s:.0f} s for the writer lease of {self.url}, held by {_holder(body)} "
                        f"until {_utc(until)}, to end"
                    )
                time.sleep(min(2.0, max(0.05, deadline - time.monotonic())))
                continue
            mine = f"{self.prefix}/{NAME}{gen + 1:08d}.json"
            if self.store.put_new(mine, self._body()) and self._reads_back(mine):
                self.key = mine
                if key is not None:  # the expired lease this took over
                    with contextlib.suppress(KitError):
                        self.store.delete(key)
                threading.Thread(target=self._renew, name="kit-obs-lease", daemon=True).start()
                return self
        raise LockedError(f"{self.url}: could not take its writer lease; run it again.")

    def _reads_back(self, key: str) -> bool:
        raw = self.store.get_bytes(key)
        try:
            return raw is not None and json.loads(raw).get("token") == self.token
        except (ValueError, AttributeError):
            return False

    def check(self, read: bool = True) -> None:
        """LockedError unless this writer still holds the lease, with an eighth of its term left (a takeover needs
        it expired): read from OBS (`read`), or as the renewal last saw it."""
        if not read:
            if self.lost:
                raise LockedError(self.lost)
            return
        _gen, key, body = self._current()
        until = body.get("until") if isinstance(body.get("until"), (int, float)) else 0
        ours = key == self.key and body.get("token") == self.token
        if not ours or until < time.time() + self.term / 8:
            who = "it expired" if ours else f"now held by {_holder(body)}" if body else "it was removed"
            self.lost = (
                f"{self.url}: this {self.what} lost its writer lease ({who}), so it publishes nothing there; "
                f"its files there may be incomplete — run it again once no other writer is at work."
            )
            raise LockedError(self.lost)

    def _renew(self) -> None:
        while not self._stop.wait(self.term / 4):
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    self.check()
                    self.store.put_bytes(self.key, self._body())
                except LockedError:
                    return
                except KitError:  # OBS unreachable for now: the next round tries again, check() decides
                    continue

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this writer's."""
        self._stop.set()
        with self._lock:  # a renewal in flight ends first: it would bring the deleted lease back
            if self.key and self._reads_back(self.key):
                self.store.delete(self.key)
            self.key = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.release()
        except KitError:  # OBS unreachable: the lease expires by itself; the error in flight says more
            if exc[0] is None:
                raise
