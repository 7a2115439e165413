"""Child processes of the demo: started, killed (-9), restarted and stopped by name."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = ["ManagedProcess", "free_port"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ManagedProcess:
    """One child process with its log file (appended to across restarts).

    ``unexpected_exits`` counts exits the demo did not cause (a crash is a finding).
    """

    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    log_path: Path
    cwd: Path | None = None
    kills: int = 0
    starts: int = 0
    pauses: int = 0
    unexpected_exits: list[int] = field(default_factory=list)
    #: Seconds each unexpected exit came after its process was started (same order).
    exit_uptimes_s: list[float] = field(default_factory=list)
    _started_at: float = field(default=0.0, repr=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def restarts(self) -> int:
        return max(0, self.starts - 1)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start (or restart) the process; output goes to ``log_path``."""
        if self.alive():
            return
        self.starts += 1
        if self._log is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("ab")
        self._note(f"demo starts {self.name}: {' '.join(self.argv)}")
        self._started_at = time.monotonic()
        self._proc = subprocess.Popen(
            list(self.argv),
            env=dict(self.env),
            cwd=self.cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our signals reach only this child, never the demo
        )

    def check(self) -> int | None:
        """Exit code if the process ended on its own since the last check (recorded)."""
        if self._proc is None:
            return None
        code = self._proc.poll()
        if code is None:
            return None
        self.unexpected_exits.append(code)
        self.exit_uptimes_s.append(round(time.monotonic() - self._started_at, 1))
        self._proc = None
        return code

    def kill9(self) -> None:
        """SIGKILL: no cleanup, no flush, no commit; exactly the crash the design must survive."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._note("demo sends SIGKILL")
        self._proc.send_signal(signal.SIGKILL)
        self._proc.wait()
        self._proc = None
        self.kills += 1

    def pause(self) -> None:
        """SIGSTOP: the process freezes (timers, heartbeats, sockets unread) until resumed."""
        if self._proc is not None and self._proc.poll() is None:
            self._note("demo sends SIGSTOP")
            self._proc.send_signal(signal.SIGSTOP)
            self.pauses += 1

    def resume(self) -> None:
        """SIGCONT after :meth:`pause` (a no-op for a running process)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
            self._note("demo sent SIGCONT")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s`` seconds. Returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            self._note("demo sends SIGTERM")
            proc.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._note(f"no exit after {timeout_s:g} s: SIGKILL")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return proc.returncode

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the log (for error reports)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _note(self, message: str) -> None:
        if self._log is not None:
            self._log.write(f"=== [{time.strftime('%H:%M:%S')}] {message}\n".encode())
            self._log.flush()
