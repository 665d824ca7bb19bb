"""`splitserve up` as a test's process: started with the given flags, its output read line by
line, its URL taken from the line that says it serves. `running_up` is the body of a module
fixture that owns one; the session fixture `shared_up` (conftest.py) hands one process per flag
list to every file that only sends it requests."""

import os
import re
import signal
import subprocess
import threading

from routerkit import free_port
from workerproc import CLI


class UpProcess:
    def __init__(self, *args):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [CLI, "up", "--port", str(self.port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self.url = None
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            match = re.match(r"splitserve up: serving (\S+)", line)
            if match:
                self.url = match.group(1)
                self.ready.set()
        self.ready.set()

    def wait(self, timeout=300):
        assert self.ready.wait(timeout) and self.url, "splitserve up did not start:\n" + "".join(self.lines[-30:])
        return self


def running_up(*args: str):
    """The body of a module fixture: `splitserve up` with `args`, yielded once it serves, stopped
    (SIGINT, as Ctrl-C) after the module's tests."""
    process = UpProcess(*args).wait()
    yield process
    stop(process)


def stop(process: UpProcess) -> None:
    """SIGINT, as Ctrl-C, and wait for it to exit."""
    if process.proc.poll() is None:
        process.proc.send_signal(signal.SIGINT)
        process.proc.wait(60)
