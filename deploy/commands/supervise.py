"""``hybridflow run ... --supervise``: a parent that restarts the controller with ``--resume``.

A dead role group is restarted inside the run (``controller/supervisor.py``); the controller
itself holds the run, so its death (``kill -9``, the out-of-memory killer, a lost login shell)
ends it. ``--supervise`` runs the same command as a child process, its ``--run-dir`` fixed up front
(``runs/<name>-<time>`` when none is given) so that every try writes the same run directory. When
the child dies or fails, the command runs again as ``--resume --run-dir DIR`` (the other options
kept) from the run's last complete checkpoint, or as it was first given when there is none yet
(the run directory then holds no checkpoint, so a fresh run accepts it). The restart policy is a
group's (Erlang/OTP's intensity and period): at most ``--max-restarts`` restarts within
``--restart-window`` seconds, after a back-off of 1, 5, then 30 seconds; past it, the supervisor
exits with the child's status and names the options to raise.

What it does not restart: a run that ended well (exit 0), bad input (exit 2: the same input fails
again; a run directory the supervisor made for it is removed, as a run that fails its checks
leaves nothing), Ctrl-C (exit 130). SIGINT and SIGTERM to the supervisor are passed on to the
child, which runs in a session of its own (a terminal's Ctrl-C reaches the supervisor alone, so
the child is told once) and is waited for; the child dies with the supervisor
(``PR_SET_PDEATHSIG``), even when that is killed with SIGKILL. It does not supervise role groups
(the controller does), nor a controller on another host.

Each start and restart is a line on stderr and a JSON line in ``RUN_DIR/supervise.jsonl``; the
child's pid is in ``RUN_DIR/controller.pid``, rewritten at each start.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from types import FrameType

from controller.placement import RestartPolicy

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
NOT_RESTARTED = (0, EXIT_BAD_INPUT, EXIT_INTERRUPTED)
BACKOFF_S = [1.0, 5.0, 30.0]  # before the 1st, 2nd, then every later restart within the window
LOG = "supervise.jsonl"
PID_FILE = "controller.pid"
STOP_POLL_S = 0.1  # how often a back-off looks for a forwarded stop

#: the options of ``run`` and ``controller`` by full name, and whether each takes a value
OPTIONS = {
    "--run-dir": True,
    "--resume": False,
    "--quick": False,
    "--set": True,
    "--stop-after": True,
    "--json": False,
    "--supervise": False,
    "--max-restarts": True,
    "--restart-window": True,
    "--clusters": True,
    "--bind": True,
    "--wait": True,
    "--keys": True,
}
OWN = ("--supervise", "--max-restarts", "--restart-window", "--run-dir")  # the child gets its own

_LIBC = ctypes.CDLL(None)  # loaded here: the child between fork and exec only makes a call


def _die_with_parent(parent: int) -> None:  # runs in the child between fork and exec
    _LIBC.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the supervisor died before the call: nobody would be told
        os._exit(1)


def supervise_command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``--supervise`` at the command line's edge: ``argv`` is ``sys.argv``, whose words (less
    the program) the child runs again. Bad options exit 2 before anything starts."""
    words = list(argv[1:])
    try:
        if _command_of(words) != args.command:
            raise ValueError("--supervise restarts the command line it was given (sys.argv)")
        if args.resume and args.run_dir is None:
            raise ValueError("--resume needs --run-dir (the run to continue)")
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts {args.max_restarts}: give 0 (never) or more")
        if args.restart_window <= 0:
            raise ValueError(f"--restart-window {args.restart_window:g}: give seconds > 0")
        policy = RestartPolicy(
            max=args.max_restarts, window_s=args.restart_window, backoff_s=BACKOFF_S
        )
    except ValueError as exc:
        print(f"hybridflow {args.command}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir = args.run_dir or default_run_dir(args.experiment, args.set, args.quick)
    return Supervision(words, run_dir, policy).run()


def _command_of(words: Sequence[str]) -> str | None:
    """The command word: the first that is no option (``hybridflow``'s own options, before the
    command, take no value)."""
    return next((w for w in words if not w.startswith("-")), None)


def default_run_dir(experiment: Path | None, overrides: Sequence[str], quick: bool) -> Path:
    """``runs/<name>-<time>`` as a fresh run names its folder, fixed before the first start so
    every try writes the same one; the file's stem when the experiment does not load (the
    child then says why, and exits 2)."""
    from deploy.experiment import load  # pydantic and the config models: only on this path

    name = experiment.stem if experiment is not None else "run"
    if experiment is not None:
        try:
            name = load(experiment, overrides, quick).name
        except (ValueError, OSError):  # ExperimentError and pydantic's are ValueErrors
            pass  # the child reports it, as it would without --supervise
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def child_argv(argv: Sequence[str], run_dir: Path, resume: bool) -> list[str]:
    """``argv`` (the words after the program: options of ``hybridflow``, the command, its
    options) without the supervisor's options and with ``--run-dir`` fixed; on ``resume`` the
    experiment file and ``--quick`` give way to ``--resume`` (the run's saved config holds
    them). Options are written in full (argparse takes any unique prefix: ``--sup``)."""
    words = list(argv)
    start = words.index(_command_of(words) or "") + 1
    kept, rest = words[:start], words[start:]
    if resume:
        kept.append("--resume")
    i = 0
    while i < len(rest):
        name, eq, value = rest[i].partition("=")
        full = _full_name(name)
        pair = [full + eq + value] if eq or not OPTIONS.get(full) else [full, *rest[i + 1 : i + 2]]
        i += 1 if len(pair) == 1 else 2
        if full in OWN or (resume and full in ("--quick", "--resume")):
            continue
        if resume and not name.startswith("-"):
            continue  # the experiment file: a resumed run reads RUN_DIR/config.yaml
        kept += pair
    return [*kept, "--run-dir", str(run_dir)]


def _full_name(word: str) -> str:
    """The option ``word`` names (itself, or the one option it is a prefix of), else ``word``."""
    if not word.startswith("--") or word in OPTIONS:
        return word
    found = [o for o in OPTIONS if o.startswith(word)]
    return found[0] if len(found) == 1 else word


def _cause(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def _status(code: int) -> int:
    """A child's return code as a shell reports it (128 + the signal that killed it)."""
    return code if code >= 0 else 128 - code


class Supervision:
    """One supervised run: the child's tries under the policy, the signals passed on, the
    records. ``program`` starts the child (tests give a fake one)."""

    def __init__(
        self,
        argv: Sequence[str],
        run_dir: Path,
        policy: RestartPolicy,
        program: Sequence[str] = (sys.executable, "-m", "deploy.cli"),
    ) -> None:
        self.argv, self.run_dir, self.policy = list(argv), run_dir, policy
        self.program = list(program)
        self.restarts: deque[float] = deque()  # when each restart within the window began
        self.tries = 0
        self.child: subprocess.Popen[bytes] | None = None
        self.stop_signal: int | None = None  # SIGINT/SIGTERM, once one came

    def run(self) -> int:
        """Start the child, and again as the policy allows; the last child's status."""
        created = not self.run_dir.exists()
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = self._loop()
        finally:
            if self.child is not None and self.child.poll() is None:  # the supervisor failed
                self.child.kill()
                self.child.wait()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if code == EXIT_BAD_INPUT and created and self.tries == 1:
            shutil.rmtree(self.run_dir, ignore_errors=True)  # only this command wrote there
        if code == 0:
            self._annotate_summary()
        return code

    def _annotate_summary(self) -> None:
        """The run's ``summary.json`` (written by the last try) with what the supervisor saw:
        the controller's tries, restarts and their causes, and the wall time of all tries (a
        try's own ``wall_s`` covers only itself)."""
        path = self.run_dir / "summary.json"
        if not path.is_file():
            return
        tries = [json.loads(line) for line in (self.run_dir / LOG).read_text().splitlines()]
        summary = json.loads(path.read_text())
        summary["controller_supervision"] = {
            "tries": len(tries),
            "restarts": len(tries) - 1,
            "causes": [t["cause"] for t in tries if t["cause"]],
        }
        summary["wall_s_all_tries"] = round(time.time() - float(tries[0]["time"]), 2)
        aside = path.with_name("summary.json.tmp")
        aside.write_text(json.dumps(summary, indent=1))
        aside.replace(path)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signal = signum
        if self.child is not None:
            self.child.send_signal(signum)  # nothing when it already ended

    def _loop(self) -> int:
        cause = None
        while True:
            self.tries += 1
            step = _checkpoint_step(self.run_dir) if self.tries > 1 else None
            argv = child_argv(self.argv, self.run_dir, resume=step is not None)
            self._record(cause, step, argv)
            code = self._start(argv)
            if code in NOT_RESTARTED or self.stop_signal is not None:
                return _status(code)
            cause = _cause(code)
            wait_s = self._backoff()
            if wait_s is None:
                print(
                    f"hybridflow --supervise: the controller ended ({cause}) after "
                    f"{len(self.restarts)} restart(s) within {self.policy.window_s:g} s; not "
                    "restarted again (raise --max-restarts or --restart-window)",
                    file=sys.stderr,
                )
                return _status(code)
            print(f"hybridflow --supervise: restarting in {wait_s:g} s", file=sys.stderr)
            if self._stopped_within(wait_s):
                return EXIT_INTERRUPTED

    def _backoff(self) -> float | None:
        """The back-off before the next restart, counted as done; None: the policy is spent."""
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > self.policy.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.policy.max:
            return None
        self.restarts.append(now)
        return self.policy.backoff(len(self.restarts) - 1)

    def _stopped_within(self, wait_s: float) -> bool:
        """Wait ``wait_s`` seconds, less when SIGINT or SIGTERM comes; whether one came."""
        deadline = time.monotonic() + wait_s
        while self.stop_signal is None and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, STOP_POLL_S))
        return self.stop_signal is not None

    def _start(self, argv: list[str]) -> int:
        """Run the child to its end (a forwarded signal included); its return code."""
        self.child = subprocess.Popen(
            [*self.program, *argv],
            start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor, which tells it
            preexec_fn=partial(_die_with_parent, os.getpid()),
        )
        if self.stop_signal is not None:  # it came while the child started
            self.child.send_signal(self.stop_signal)
        pid_file = self.run_dir / PID_FILE
        tmp = pid_file.with_name(PID_FILE + ".tmp")
        tmp.write_text(f"{self.child.pid}\n")
        os.replace(tmp, pid_file)
        return self.child.wait()  # retried after each signal handler (PEP 475)

    def _record(self, cause: str | None, step: int | None, argv: list[str]) -> None:
        record = {
            "event": "controller_start" if self.tries == 1 else "controller_restart",
            "try": self.tries,
            "cause": cause,
            "resumed_from_step": step,
            "time": round(time.time(), 3),
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / LOG, "a") as out:
            out.write(json.dumps(record) + "\n")
        last = f" (the last ended: {cause})" if cause else ""
        resumed = f", resuming from step {step}" if step is not None else ""
        command = shlex.join(["hybridflow", *argv])
        print(
            f"hybridflow --supervise: try {self.tries}{last}{resumed}: {command}", file=sys.stderr
        )


def _checkpoint_step(run_dir: Path) -> int | None:
    from controller.trainer import newest_step  # imported here: the supervisor stays light

    return newest_step(run_dir / "checkpoints")
