"""A server binary that tests and benchmarks run for themselves (redis-server, mooncake_master): its
process and scratch directory, and how it ends, always by its own pid. Subclasses start it (`start`)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess


class ServerProcess:
    proc: subprocess.Popen | None = None
    _dir: str = ""

    def start(self) -> ServerProcess:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, wait, then SIGKILL: by pid, only this server."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)       # a paused server cannot act on SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        if proc.stderr:
            proc.stderr.close()

    def kill(self) -> None:
        """A crash: SIGKILL, no shutdown (the port refuses connections once this returns)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(5)
        if proc.stderr:
            proc.stderr.close()

    def pause(self) -> None:
        """SIGSTOP: the port stays open and nothing answers (a hung server)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> ServerProcess:
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
