"""Run an engine server and stop it when SpecArena is gone: `python guard.py PARENT_PID -- command ...`.

A server must not outlive the app that started it, not even a crash or a kill -9. Linux's
PR_SET_PDEATHSIG would fire when the *thread* that started the server ends, and servers are started from
worker threads, so a guardian process watches the app instead: it runs the command in its own process
group, stops it when the app's process is gone or when it is itself told to stop, and exits with the
command's exit code (128 + N for a command killed by signal N). Standard library only: it runs with the
app's python, not the engine's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main() -> int:
    parent, command = int(sys.argv[1]), sys.argv[sys.argv.index("--") + 1 :]
    child = subprocess.Popen(command)

    def stop(*_) -> None:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        sys.exit(code(child.returncode))

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while child.poll() is None:
        if os.getppid() != parent:  # the app is gone: its orphans were handed to another process
            stop()
        time.sleep(0.5)
    return code(child.returncode)


def code(returncode: int | None) -> int:
    """The command's exit code, and 128 + N for a command killed by signal N, as shells report it (a negative
    code would reach the app as 256 - N, which reads as an ordinary failure)."""
    if returncode is None:
        return 0
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":
    sys.exit(main())
