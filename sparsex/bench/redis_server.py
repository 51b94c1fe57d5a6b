"""A real `redis-server` of its own, for tests and benchmarks: a free loopback port, persistence off,
its own temp dir, stopped by its pid (never by name).

    with RedisServer(maxmemory="2mb", password="s3cret") as srv:
        RedisTier(srv.url())
        srv.kill()          # a crash (SIGKILL)
        srv.start()         # the same port again

`make install` installs Debian's redis-server where it is missing; `available()` tells whether one is
on PATH or in a system bin directory (the `redis_server` fixture in tests/conftest.py skips without
it; `sparsex bench replicas` and `sparsex bench store` start one, `--redis-server PATH` names another).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from sparsex.bench.server_process import ServerProcess

_SBIN = ("/usr/sbin", "/usr/local/sbin", "/usr/bin", "/usr/local/bin")


def binary() -> str | None:
    """redis-server on PATH, else in a system bin directory; None if neither has one."""
    return shutil.which("redis-server") or shutil.which("redis-server", path=os.pathsep.join(_SBIN))


def available() -> bool:
    return binary() is not None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer(ServerProcess):
    """One redis-server process. `password` sets requirepass (the default user's password); `acl_users`
    maps a user name to (password, ACL rules, e.g. "~sparsex:shared:* +@all"). `maxmemory` ("2mb")
    comes with `policy` (allkeys-lru by default). `exe`: the redis-server binary (default: `binary()`)."""

    def __init__(self, *, port: int | None = None, password: str | None = None,
                 acl_users: dict[str, tuple[str, str]] | None = None, maxmemory: str | None = None,
                 policy: str = "allkeys-lru", extra_args: tuple[str, ...] = (), start_timeout_s: float = 10.0,
                 exe: str | None = None):
        if exe is not None and not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise RuntimeError(f"redis-server {exe!r} is not an executable file")
        exe = exe or binary()
        if exe is None:
            raise RuntimeError("redis-server not found on PATH (make install installs it from Debian)")
        self.exe = exe
        self.port = port or free_port()
        self.password = password
        self.acl_users = dict(acl_users or {})
        self.maxmemory = maxmemory
        self.policy = policy
        self.extra_args = tuple(extra_args)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="sparsex-redis-"))
        self.log_path = self._dir / "redis.log"

    # ---- urls and clients ---------------------------------------------------------------------
    def url(self, *, password: str | None = ..., user: str | None = None, db: int = 0) -> str:
        """redis:// url of this server; by default with its requirepass password (pass None for none)."""
        pw = self.password if password is ... else password
        auth = f"{user or ''}:{pw}@" if pw is not None else (f"{user}@" if user else "")
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def client(self, **kw) -> redis.Redis:
        """An admin client (the default user with its password)."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=2, socket_connect_timeout=2, **kw)

    # ---- life cycle ---------------------------------------------------------------------------
    def _args(self) -> list[str]:
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--dir", str(self._dir), "--logfile", str(self.log_path)]
        if self.password is not None:
            args += ["--requirepass", self.password]
        for name, (pw, rules) in self.acl_users.items():
            args += ["--user", name, "on", f">{pw}", *rules.split()]
        if self.maxmemory is not None:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        return args + list(self.extra_args)

    def start(self) -> "RedisServer":
        """Start (again, on the same port) and wait until PING answers."""
        if self.running:
            return self
        self.proc = subprocess.Popen(self._args(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        deadline = time.monotonic() + self.start_timeout_s
        probe = self.client()
        try:
            while True:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode(errors="replace")
                    log = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
                    self.proc = None
                    raise RuntimeError(f"redis-server exited at start (port {self.port}): {err}{log}")
                try:
                    if probe.ping():
                        return self
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING "
                                       f"in {self.start_timeout_s}s")
                time.sleep(0.01)
        finally:
            probe.close()
