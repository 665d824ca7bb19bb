"""A process a launcher starts and owns (`up`'s workers; the sidecar and EPP of `up --gateway envoy`).

Its output is forwarded to stderr, each line prefixed with its name; the last lines are kept for
the error when it fails. It binds port 0 and names the ports it got on a line of its own (a port
probed free here could be taken by any process's outgoing connection before the child bound it):
`wait_ready` returns that line's match. It runs in its own session, so the terminal's Ctrl-C
reaches only the launcher, which stops its children in order; if the launcher is killed outright,
the kernel sends the child SIGTERM (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

STOP_TIMEOUT_S = 15
_TAIL_LINES = 40


class Child:
    def __init__(self, name: str, argv: list[str], ready_line: re.Pattern, *, title: str | None = None):
        """`name` prefixes its output lines; `title` names it in errors (default: the name)."""
        self.name = name
        self.title = title or name
        self.argv = argv
        self.ready_line = ready_line
        self.proc: subprocess.Popen | None = None
        self.ready: re.Match | None = None  # its ready line, once printed
        self.tail: list[str] = []
        self._printed = threading.Event()  # set by the ready line, or when the output ends

    def start(self) -> Child:
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        return self

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.tail = (self.tail + [line])[-_TAIL_LINES:]
            if self.ready is None and (match := self.ready_line.search(line)):
                self.ready = match
                self._printed.set()
            sys.stderr.write(f"[{self.name}] {line}")
        self._printed.set()  # the process ended: wait_ready tells which

    def wait_ready(self, timeout_s: float) -> re.Match:
        """Its ready line; RuntimeError with its last lines if it exits or stays silent first."""
        if not self._printed.wait(timeout_s) or self.ready is None or self.proc.poll() is not None:
            raise RuntimeError(f"the {self.title} did not start:\n" + self.last_lines())
        return self.ready

    def last_lines(self) -> str:
        return "".join(self.tail[-20:])

    def stop(self) -> None:
        """SIGTERM (the child drains), then SIGKILL after STOP_TIMEOUT_S."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
