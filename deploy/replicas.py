#!/usr/bin/env python3
"""Run N `sparsex serve` replicas behind nginx on one host, and stop them all.

    .venv/bin/python deploy/replicas.py --replicas 2 --port 8080 -- --kv-cache-memory 2G
    .venv/bin/python deploy/replicas.py --replicas 2 --port 8080 --balance conversation -- --cache prefix

Replica i listens on 127.0.0.1:<replica-port + i> (default replica-port: --port + 1); nginx
listens on --host:--port with deploy/nginx.conf rendered for those ports: the `listen` line, the
upstream's `server` lines and the balancing policy (`least_conn`, or `conversation`: consistent
hashing on the X-Conversation-Id header) are rewritten, nothing else. Everything after `--` is
passed to every `sparsex serve`. nginx runs in the foreground of its own process (`daemon off`)
with its prefix (pid, logs, temp dirs) under --workdir, so no root is needed; each replica logs to
<workdir>/replica-<port>.log. Ready = every replica's /health and nginx's /health answer 200.
Ctrl-C / SIGTERM stops nginx (graceful), then the replicas (SIGTERM: they drain), by pid.

Stdlib only. tests/test_replicas_nginx.py uses `Replica` and `Nginx` from here.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_TEMPLATE = HERE / "nginx.conf"
BALANCES = ("least_conn", "conversation")


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The status of GET url, or None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _stop(proc: subprocess.Popen, sig: int, timeout: float, group: bool = False) -> None:
    """Send `sig` to proc, wait up to `timeout`, then SIGKILL it (and its process group, when it
    leads one of its own) and reap it."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            pass
    if group:                # nginx: its workers are in its process group (start_new_session)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


class Replica:
    """One `sparsex serve` process on 127.0.0.1:port."""

    def __init__(self, port: int, serve_args: list[str] = (), workdir: Path | str = ".", host: str = "127.0.0.1",
                 env: dict[str, str] | None = None):
        self.port, self.host, self.serve_args = port, host, list(serve_args)
        self.log_path = Path(workdir) / f"replica-{port}.log"
        self.env = env
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "Replica":
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")     # works from a checkout too
        cmd = [sys.executable, "-m", "sparsex.entrypoints.serve_cli", *self.serve_args,
               "--host", self.host, "--port", str(self.port)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:            # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)   # Ctrl-C reaches the launcher only
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        return self.alive() and http_status(self.url + "/health") == 200

    def wait_healthy(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if not self.alive():
                raise RuntimeError(f"replica {self.address} exited ({self.proc and self.proc.returncode}):\n"
                                   + _tail(self.log_path))
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {self.address} not healthy after {timeout:.0f} s:\n" + _tail(self.log_path))
            time.sleep(0.25)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send a signal (default SIGKILL: a crash) without waiting."""
        if self.alive():
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (the server stops accepting, finishes its requests, exits), SIGKILL after `timeout`."""
        if self.proc is not None:
            _stop(self.proc, signal.SIGTERM, timeout)


def render_config(template: str, replicas: list[str], listen: str, balance: str = "least_conn") -> str:
    """deploy/nginx.conf with `listen <listen>;`, one `server` line per replica address (keeping the
    template's parameters: max_fails, fail_timeout) and the `balance` policy's line active."""
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    if not replicas:
        raise ValueError("at least one replica")
    block = re.search(r"^([ \t]*)# BEGIN REPLICAS\n(.*?)^[ \t]*# END REPLICAS\n", template, re.M | re.S)
    first = block and re.search(r"^\s*server\s+\S+(.*);", block.group(2), re.M)
    if not first:
        raise ValueError("template has no '# BEGIN REPLICAS' ... '# END REPLICAS' block with a server line")
    indent, params = block.group(1), first.group(1)
    servers = "".join(f"{indent}server {addr}{params};\n" for addr in replicas)
    out = template[:block.start()] + f"{indent}# BEGIN REPLICAS\n{servers}{indent}# END REPLICAS\n" + template[block.end():]
    out, n = re.subn(r"^([ \t]*)listen\s+\S+;(.*# LISTEN)$", lambda m: f"{m.group(1)}listen {listen};{m.group(2)}",
                     out, flags=re.M)
    if n != 1:
        raise ValueError("template needs exactly one 'listen ...;  # LISTEN' line")

    def switch(m: re.Match) -> str:
        indent, directive, name = m.group(1), m.group(2).strip(), m.group(3)
        line = f"{indent}{'' if name == balance else '# '}{directive}"
        return f"{line.ljust(64)}# BALANCE {name}"

    out, n = re.subn(r"^([ \t]*)(?:#\s*)?(\S[^#\n]*;)\s*# BALANCE (\S+)$", switch, out, flags=re.M)
    if n < 2:
        raise ValueError("template needs its '# BALANCE <policy>' lines")
    return out


def _traversable_by_others(path: Path) -> bool:
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents])


class Nginx:
    """nginx (foreground, unprivileged) balancing `replicas`, with its prefix dir `prefix`."""

    def __init__(self, replicas: list[str], port: int, prefix: Path | str, host: str = "127.0.0.1",
                 balance: str = "least_conn", template: Path | str = DEFAULT_TEMPLATE, binary: str | None = None):
        self.replicas, self.port, self.host, self.balance = list(replicas), port, host, balance
        self.prefix = Path(prefix).resolve()
        self.template = Path(template)
        self.binary = binary or find_nginx()
        if self.binary is None:
            raise FileNotFoundError("nginx not found (Debian/Ubuntu: apt-get install nginx)")
        self.conf_path = self.prefix / "nginx.conf"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def access_log(self) -> Path:
        return self.prefix / "access.log"

    @property
    def error_log(self) -> Path:
        return self.prefix / "error.log"

    def _cmd(self, *extra: str) -> list[str]:
        directives = "daemon off;"
        # As root, nginx runs its workers as `nobody`, who must be able to enter the prefix dir (its
        # temp files live there). A prefix inside a private dir (pytest's tmp is 0700): keep root.
        if os.geteuid() == 0 and not _traversable_by_others(self.prefix):
            directives += " user root;"
        return [self.binary, "-p", str(self.prefix), "-c", str(self.conf_path), "-g", directives, *extra]

    def prepare(self) -> "Nginx":
        """Render the config into the prefix dir and check it (`nginx -t`); `start` does it too."""
        self.prefix.mkdir(parents=True, exist_ok=True)
        self.conf_path.write_text(render_config(self.template.read_text(), self.replicas,
                                                f"{self.host}:{self.port}", self.balance))
        try:
            check = subprocess.run(self._cmd("-t", "-q"), capture_output=True, text=True)
        except OSError as e:
            raise RuntimeError(f"cannot run nginx {self.binary!r}: {e}") from e
        if check.returncode != 0:
            raise RuntimeError(f"nginx -t failed for {self.conf_path}:\n{check.stderr}")
        return self

    def start(self) -> "Nginx":
        self.prepare()
        with open(self.prefix / "stderr.log", "ab") as log:
            self.proc = subprocess.Popen(self._cmd(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def reload(self, replicas: list[str], timeout: float = 30.0) -> None:
        """Balance `replicas` from now on (a replica joins or leaves): the config is rendered again and
        checked, then SIGHUP, nginx's graceful reload: new workers take the new upstream, the old ones
        finish their requests and exit. Returns once every worker is a new one, so the next request is
        balanced over `replicas` (workers are the master's children: /proc/<pid>/task/<pid>/children)."""
        if not self.alive():
            raise RuntimeError("nginx is not running")
        old = set(self._workers())
        self.replicas = list(replicas)
        self.prepare()
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while True:
            workers = set(self._workers())
            if workers and not workers & old:
                return
            if not self.alive():
                raise RuntimeError(f"nginx exited on reload ({self.proc.returncode}):\n" + _tail(self.error_log))
            if time.monotonic() > deadline:
                raise TimeoutError(f"nginx workers not replaced {timeout:.0f} s after SIGHUP:\n" + _tail(self.error_log))
            time.sleep(0.05)

    def _workers(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            return [int(p) for p in path.read_text().split()]
        except OSError:
            return []

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until GET /health through nginx answers 200 (nginx is up and reaches a healthy replica)."""
        deadline = time.monotonic() + timeout
        while http_status(self.url + "/health") != 200:
            if not self.alive():
                raise RuntimeError(f"nginx exited ({self.proc and self.proc.returncode}):\n"
                                   + _tail(self.prefix / "stderr.log") + "\n" + _tail(self.error_log))
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url}/health not 200 after {timeout:.0f} s:\n" + _tail(self.error_log))
            time.sleep(0.2)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGQUIT: stop accepting, finish the requests in flight; SIGKILL to its group after `timeout`."""
        if self.proc is not None:
            _stop(self.proc, signal.SIGQUIT, timeout, group=True)


def find_nginx() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    for path in ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx"):
        if os.access(path, os.X_OK):
            return path
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, serve_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="deploy/replicas.py", description=__doc__.split("\n\n")[0],
                                epilog="Arguments after `--` go to every `sparsex serve`.")
    p.add_argument("--replicas", type=int, default=2, help="number of sparsex serve processes (default 2)")
    p.add_argument("--port", type=int, default=8080, help="nginx's port (default 8080)")
    p.add_argument("--host", default="127.0.0.1", help="nginx's address (default 127.0.0.1)")
    p.add_argument("--replica-port", type=int, default=None, help="first replica's port (default --port + 1)")
    p.add_argument("--balance", choices=BALANCES, default="least_conn",
                   help="least_conn (default), or conversation: consistent hash on X-Conversation-Id")
    p.add_argument("--config", default=str(DEFAULT_TEMPLATE), help="nginx config template (default deploy/nginx.conf)")
    p.add_argument("--workdir", default=None, help="nginx prefix and replica logs (default: a new dir in /tmp)")
    p.add_argument("--nginx", default=None, help="nginx binary (default: nginx on PATH, else /usr/sbin/nginx)")
    p.add_argument("--restart", action="store_true", help="start a replica again when it exits")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the replicas (default 600)")
    args = p.parse_args(own)
    if args.replicas < 1:
        p.error("--replicas must be >= 1")

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sparsex-lb-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if args.workdir is None:
        workdir.chmod(0o755)
    base = args.replica_port or args.port + 1
    replicas = [Replica(base + i, serve_args, workdir) for i in range(args.replicas)]
    try:       # the config is checked before the replicas spend a minute loading the model
        nginx = Nginx([r.address for r in replicas], args.port, workdir / "nginx", args.host, args.balance,
                      args.config, args.nginx).prepare()
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"replicas.py: {e}", file=sys.stderr)
        return 1
    stopping = False
    reported: set[int] = set()

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        for r in replicas:
            r.start()
            print(f"replica {r.url}  pid {r.proc.pid}  log {r.log_path}", flush=True)
        deadline = time.monotonic() + args.ready_timeout
        while not stopping and not all(r.healthy() for r in replicas):
            for r in replicas:
                if not r.alive():
                    raise RuntimeError(f"replica {r.address} exited ({r.proc.returncode}):\n" + _tail(r.log_path))
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas not healthy after {args.ready_timeout:.0f} s (logs in {workdir})")
            time.sleep(0.5)
        if not stopping:
            nginx.start()
            print(f"nginx   {nginx.url}  pid {nginx.proc.pid}  balance {args.balance}  prefix {nginx.prefix}",
                  flush=True)
            nginx.wait_ready()
            print(f"ready: {nginx.url}/v1  (Ctrl-C stops everything)", flush=True)
        while not stopping:
            time.sleep(1.0)
            if not nginx.alive():
                print(f"nginx exited ({nginx.proc.returncode}); stopping", file=sys.stderr, flush=True)
                code = 1
                break
            for r in replicas:
                if r.alive() or r.port in reported:
                    continue
                if args.restart:
                    print(f"replica {r.url} exited ({r.proc.returncode}); starting it again", flush=True)
                    r.start()
                else:
                    print(f"replica {r.url} exited ({r.proc.returncode}); nginx sends its requests to the others",
                          file=sys.stderr, flush=True)
                    reported.add(r.port)
    except (RuntimeError, TimeoutError, FileNotFoundError, ValueError) as e:
        print(f"replicas.py: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        nginx.stop()
        for r in replicas:
            r.stop()
        print("stopped", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
