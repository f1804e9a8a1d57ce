"""``hybridflow run ... --supervise``: a parent that restarts the controller with ``--resume``.

A dead role group is restarted inside the run (``controller/supervisor.py``); the controller
itself holds the run, so its death (``kill -9``, the out-of-memory killer, a lost login shell)
ends it. ``--supervise`` runs the same command as a child process and, when the child dies or
fails, runs it again with ``--resume --run-dir DIR`` (from the run's last checkpoint; from the
start when there is none yet), under a policy like a group's: at most ``--max-restarts`` within
``--restart-window`` seconds, after a back-off of 1, 5, then 30 seconds.

What it does not restart: a run that ended well (exit 0), bad input (exit 2: the same input
fails again), Ctrl-C (exit 130, and SIGINT/SIGTERM to the supervisor are passed on to the child
and end it). The child dies with the supervisor (``PR_SET_PDEATHSIG``). Each start and restart is
a line on stderr and a JSON line in ``RUN_DIR/supervise.jsonl``; the child's pid is in
``RUN_DIR/controller.pid``.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
BACKOFF_S = (1.0, 5.0, 30.0)  # before the 1st, 2nd, 3rd and later restart within the window
LOG = "supervise.jsonl"
PID_FILE = "controller.pid"

_LIBC = ctypes.CDLL(None)  # loaded here: the child between fork and exec only makes a call


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _LIBC.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


#: options of ``run`` / ``controller`` that take a value (the word after them is no file)
VALUED = {
    "--run-dir",
    "--set",
    "--stop-after",
    "--clusters",
    "--bind",
    "--wait",
    "--keys",
    "--max-restarts",
    "--restart-window",
}
OWN = {"--supervise", "--max-restarts", "--restart-window", "--run-dir"}


def child_argv(argv: Sequence[str], run_dir: Path, resume: bool) -> list[str]:
    """``argv`` (``run ...``: the words after the program) without the supervisor's own
    options, with ``--run-dir`` fixed; on ``resume`` the experiment file and ``--quick`` give way
    to ``--resume`` (the run's saved config holds them)."""
    words = [argv[0]]
    rest = list(argv[1:])
    i = 0
    while i < len(rest):
        word = rest[i]
        name = word.split("=", 1)[0]
        takes = name in VALUED and "=" not in word
        pair = rest[i : i + 2] if takes else [word]
        i += len(pair)
        if name in OWN or (resume and name in ("--quick", "--resume")):
            continue
        if resume and not word.startswith("-"):
            continue  # the experiment file: a resumed run reads RUN_DIR/config.yaml
        words += pair
    words += ["--run-dir", str(run_dir)]
    if resume:
        words.insert(1, "--resume")
    return words


def default_run_dir(experiment: Path | None) -> Path:
    """Where a run without ``--run-dir`` goes, fixed before the first start so every try writes
    the same folder: ``runs/<name>-<time>`` as ``hybridflow run`` names it."""
    import yaml

    name = "experiment"
    if experiment is not None and experiment.is_file():
        found = yaml.safe_load(experiment.read_text())
        if isinstance(found, dict) and isinstance(found.get("name"), str):
            name = found["name"]
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _cause(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


class Supervision:
    """One supervised run: the child's starts, the policy, the records."""

    def __init__(self, argv: Sequence[str], run_dir: Path, max_restarts: int, window_s: float):
        self.argv, self.run_dir = list(argv), run_dir
        self.max_restarts, self.window_s = max_restarts, window_s
        self.restarts: deque[float] = deque()
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = False

    def run(self) -> int:
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def _loop(self) -> int:
        attempt, resume, cause = 0, False, ""
        while True:
            attempt += 1
            step = _checkpoint_step(self.run_dir) if resume else None
            argv = child_argv(self.argv, self.run_dir, resume and step is not None)
            self._record(attempt, cause, step, argv)
            code = self._start(argv)
            if code in (0, EXIT_BAD_INPUT, EXIT_INTERRUPTED) or self.stopping:
                return code if code >= 0 else 128 - code
            cause = _cause(code)
            now = time.monotonic()
            while self.restarts and now - self.restarts[0] > self.window_s:
                self.restarts.popleft()
            if len(self.restarts) >= self.max_restarts:
                print(
                    f"hybridflow --supervise: the controller ended ({cause}) and was restarted "
                    f"{len(self.restarts)} time(s) within {self.window_s:.0f} s already; not "
                    "again (raise --max-restarts or --restart-window)",
                    file=sys.stderr,
                )
                return code if code >= 0 else 128 - code
            wait_s = BACKOFF_S[min(len(self.restarts), len(BACKOFF_S) - 1)]
            self.restarts.append(now)
            print(
                f"hybridflow --supervise: the controller ended ({cause}); restarting in "
                f"{wait_s:g} s",
                file=sys.stderr,
            )
            time.sleep(wait_s)  # the policy's back-off, not a synchronisation
            if self.stopping:
                return EXIT_INTERRUPTED
            resume = True

    def _start(self, argv: list[str]) -> int:
        self.child = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", *argv], preexec_fn=_die_with_parent
        )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        pid_file = self.run_dir / PID_FILE
        tmp = pid_file.with_suffix(".tmp")
        tmp.write_text(f"{self.child.pid}\n")
        os.replace(tmp, pid_file)
        while True:
            try:
                return self.child.wait()
            except InterruptedError:  # a forwarded signal; keep waiting for the child's end
                continue

    def _record(self, attempt: int, cause: str, step: int | None, argv: list[str]) -> None:
        record = {
            "event": "controller_start" if attempt == 1 else "controller_restart",
            "try": attempt,
            "cause": cause or None,
            "resumed_from_step": step,
            "time": round(time.time(), 3),
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / LOG, "a") as out:
            out.write(json.dumps(record) + "\n")
        said = f" after {cause}" if cause else ""
        resumed = f", resuming from step {step}" if step is not None else ""
        print(
            f"hybridflow --supervise: start {attempt}{said}{resumed}: hybridflow " + " ".join(argv),
            file=sys.stderr,
        )


def _checkpoint_step(run_dir: Path) -> int | None:
    from controller.trainer import newest_step  # imported here: the supervisor stays light

    return newest_step(run_dir / "checkpoints")


def supervise(argv: Sequence[str], run_dir: Path, max_restarts: int, window_s: float) -> int:
    """Run ``hybridflow ARGV`` under supervision; its last exit status."""
    return Supervision(argv, run_dir, max_restarts, window_s).run()
