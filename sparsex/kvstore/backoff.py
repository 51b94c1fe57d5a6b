"""A store connection's health: up, or down for `reconnect_s` after a failure, during which its owner
tries no round trip (reads miss at once, writes are dropped) and then tries again. The change to down
is logged once, the way back once; a command the server refused (it answered: the connection stays up)
is logged once per kind. Not locked: each owner calls it under its own lock."""
from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class Backoff:
    def __init__(self, name: str, reconnect_s: float):
        self.name = name                     # in the log lines: "Redis tier host:port/db", ...
        self.reconnect_s = reconnect_s
        self.up = True                       # the last round trip succeeded (or none failed yet)
        self._until = 0.0                    # time.monotonic() before which no round trip is tried
        self._refused_kinds: set[str] = set()

    @property
    def down(self) -> bool:
        return time.monotonic() < self._until

    def failed(self, what: str, e: BaseException) -> None:
        was_up, self.up = self.up, False
        self._until = time.monotonic() + self.reconnect_s
        if was_up:
            log.warning("%s: %s failed (%s: %s); down, retrying in %.1fs", self.name, what, type(e).__name__, e,
                        self.reconnect_s)

    def refused(self, what: str, e: BaseException) -> None:
        """The server answered but refused `what` (an ACL without that key or command, OOM under
        maxmemory with noeviction): the connection stays up; logged the first time per kind."""
        if what not in self._refused_kinds:
            self._refused_kinds.add(what)
            log.warning("%s: %s refused by the server (%s: %s); counted, stays up", self.name, what,
                        type(e).__name__, e)

    def succeeded(self) -> None:
        if not self.up:
            log.info("%s: serving again", self.name)
        self.up = True
