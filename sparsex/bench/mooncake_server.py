"""A real `mooncake_master` of its own, for tests and benchmarks: free loopback ports for its RPC, its
embedded HTTP metadata server and its admin/metrics server, stopped by its pid (never by name).

    with MooncakeMaster() as master:
        MooncakeTier(master.url(), index_url=redis.url())
        master.kill()          # a crash (SIGKILL): every object it indexed is gone with it
        master.start()         # the same ports again, empty
        master.pause()         # SIGSTOP: a hung master (calls block); resume() with SIGCONT
    with SegmentHolder(master, 1 << 30):     # another process lends the store 1 GiB: a client with
        ...                                  # segment=0 then moves every payload over the transport

The master holds only the object metadata: the bytes live in the segments that clients mount
(`segment=` of a mooncake:// url). The binary ships inside the `mooncake-transfer-engine-non-cuda`
wheel (`make install` installs it with the Debian libraries it needs); `available()` tells whether it
is there (the `mooncake_master` fixture in tests/conftest.py skips without it).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from sparsex.bench.server_process import ServerProcess
from sparsex.bench.redis_server import free_port


def binary() -> str | None:
    """The mooncake_master executable inside the installed mooncake package; None without one."""
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "mooncake_master")
        if os.path.isfile(path):
            return path
    return None


def available() -> bool:
    return binary() is not None


class MooncakeMaster(ServerProcess):
    """One mooncake_master process with its embedded HTTP metadata server (no etcd). `lease_ms` is the
    master's default_kv_lease_ttl (an object just read cannot be removed before it ends; Mooncake's
    default is 10 s, tests use less). `exe`: the binary (default: `binary()`)."""

    def __init__(self, *, rpc_port: int | None = None, metadata_port: int | None = None,
                 admin_port: int | None = None, lease_ms: int = 500, extra_args: tuple[str, ...] = (),
                 start_timeout_s: float = 15.0, exe: str | None = None):
        if exe is not None and not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise RuntimeError(f"mooncake_master {exe!r} is not an executable file")
        exe = exe or binary()
        if exe is None:
            raise RuntimeError("mooncake_master not found: the mooncake-transfer-engine-non-cuda wheel is not "
                               "installed (make install installs it)")
        if not os.access(exe, os.X_OK):        # a wheel unpacked without its mode bits
            os.chmod(exe, os.stat(exe).st_mode | 0o111)
        self.exe = exe
        self.rpc_port = rpc_port or free_port()
        self.metadata_port = metadata_port or free_port()
        self.admin_port = admin_port or free_port()
        self.lease_ms = lease_ms
        self.extra_args = tuple(extra_args)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="sparsex-mooncake-"))
        self.log_path = self._dir / "master.log"

    # ---- urls ---------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def url(self, **options) -> str:
        """mooncake:// url of this master (protocol tcp); `options` add query parameters (segment=64M, ...)."""
        query = "&".join([f"metadata={self.metadata_url}", "protocol=tcp", *(f"{k}={v}" for k, v in options.items())])
        return f"mooncake://{self.address}?{query}"

    def health(self) -> dict | None:
        """The admin server's /health answer; None when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/health", timeout=1) as r:
                return json.loads(r.read())
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def keys(self) -> list[str]:
        """Every object key the master indexes (its admin server's /get_all_keys)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/get_all_keys", timeout=5) as r:
            return [k for k in r.read().decode().split("\n") if k]

    # ---- life cycle ---------------------------------------------------------------------------
    def _args(self) -> list[str]:
        return [self.exe, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.metadata_port}", "--metrics_host=127.0.0.1",
                f"--metrics_port={self.admin_port}", f"--default_kv_lease_ttl={self.lease_ms}",
                "--rpc_thread_num=2", "--logtostderr", *self.extra_args]

    def start(self) -> "MooncakeMaster":
        """Start (again, on the same ports) and wait until /health says the service is ready."""
        if self.running:
            return self
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self._args(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                self.proc = None
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mooncake_master exited at start (port {self.rpc_port}): {tail}")
            h = self.health()
            if h is not None and h.get("service_ready"):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master on port {self.rpc_port} was not ready in {self.start_timeout_s}s")
            time.sleep(0.02)


_HOLDER = """
import sys, time
from sparsex.kvstore.mooncake_tier import _store_module
client = _store_module().MooncakeDistributedStore()
rc = client.setup("127.0.0.1", sys.argv[1], int(sys.argv[3]), 16 << 20, "tcp", "", sys.argv[2])
print("ready" if rc == 0 else f"setup failed {rc}", flush=True)
while rc == 0:
    time.sleep(3600)
"""


class SegmentHolder:
    """A process of its own whose Mooncake client lends the store `nbytes` of memory and does nothing
    else: what a replica on another host is to this one (its payloads cross the TCP transport, not a
    same-process copy). Stopped by its pid."""

    def __init__(self, master: MooncakeMaster, nbytes: int, start_timeout_s: float = 30.0):
        self.master, self.nbytes, self.start_timeout_s = master, nbytes, start_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> "SegmentHolder":
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER, self.master.metadata_url, self.master.address,
                                      str(self.nbytes)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + self.start_timeout_s
        line = ""
        while time.monotonic() < deadline and self.proc.poll() is None and not line:
            line = self.proc.stdout.readline().decode().strip()
        if line != "ready":
            self.stop()
            raise RuntimeError(f"the segment holder did not start: {line or 'no answer'}")
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            proc.stdout.close()

    def __enter__(self) -> "SegmentHolder":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
