"""
How a command ends when it is asked to stop: Ctrl-C (SIGINT), a scheduler's or a service manager's
SIGTERM, a closed terminal's SIGHUP, or stdout's reader gone (`| head`).

While a command starts, its imports (torch's take seconds) are not a run yet, so the process says
so in one line and ends at once, exit 128 + the signal. Not by raising: an exception raised inside
an import can leave a module half made (numpy's was seen to), and the command then went on with it
and failed later, or finished after saying it was interrupted. Once its imports are done a command
calls started(): Ctrl-C raises KeyboardInterrupt, and SIGTERM or SIGHUP raise Terminated, a
KeyboardInterrupt, so a run stopped by either keeps and removes what Ctrl-C keeps and removes (a
batch's finished results and resumable tiers, a chat session's turns) and says so in one line. Its
exit status is status(e): 130, 143 or 129, as the signal's own would be.
"""
import os
import signal

STOPS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
IGNORED = set()  # the signals this process was started ignoring (nohup's SIGHUP): they stay so


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached a started command: handled as Ctrl-C is."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def starting(command):
    """From now until started(): Ctrl-C, SIGTERM or SIGHUP end the process at once with one line
    naming command."""
    def stopped(signum, frame):
        os.write(2, f"{command}: {said(signum)} while starting; nothing was kept\n".encode())
        os._exit(128 + signum)
    for signum in STOPS:
        if signal.getsignal(signum) == signal.SIG_IGN:
            IGNORED.add(signum)
        else:
            signal.signal(signum, stopped)


def started():
    """Ctrl-C raises KeyboardInterrupt again, SIGTERM and SIGHUP Terminated, for the run's own
    handling."""
    for signum, handler in ((signal.SIGINT, signal.default_int_handler),
                            (signal.SIGTERM, terminate), (signal.SIGHUP, terminate)):
        if signum not in IGNORED:
            signal.signal(signum, handler)


def install(handlers):
    """{signal: handler} installed, but for a signal this process ignores (nohup's SIGHUP): it stays
    ignored. Returns what was there, for restore()."""
    previous = {}
    for signum, handler in handlers.items():
        previous[signum] = signal.getsignal(signum)
        if previous[signum] != signal.SIG_IGN:
            signal.signal(signum, handler)
    return previous


def restore(previous):
    """install() undone."""
    for signum, handler in previous.items():
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def terminate(signum, frame):
    """SIGTERM or SIGHUP: stop where the run is; a second one cannot cut short the cleanup that
    follows (a scheduler that means it sends SIGKILL)."""
    for other in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(other, signal.SIG_IGN)
    raise Terminated(signum)


def signum_of(e):
    """The signal a KeyboardInterrupt stands for."""
    return getattr(e, "signum", signal.SIGINT)


def said(e):
    """'interrupted (Ctrl-C)', 'stopped (SIGTERM)' or 'stopped (SIGHUP)' for a KeyboardInterrupt
    or a signal number."""
    signum = e if isinstance(e, int) else signum_of(e)
    return "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped ({STOPS[signum]})"


def status(e):
    """The exit status of a command that e stopped: 128 + its signal (130 for Ctrl-C)."""
    return 128 + signum_of(e)


def closed_stdout(command):
    """stdout's reader went away (`| head`): one line on stderr, then closed_stdout_quietly."""
    os.write(2, f"{command}: stdout was closed before the end (a broken pipe): stopped\n".encode())
    return closed_stdout_quietly()


def closed_stdout_quietly():
    """stdout pointed at /dev/null, so that the interpreter's last flush cannot fail again; returns
    the exit status, 141 (128 + SIGPIPE), as a process that signal ended."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    return 141


def ended(command, e, kept="nothing to resume: run it again"):
    """The one line a stopped command ends with (on stderr), said by the first process only (under
    torchrun the others are stopped when it ends: a refusal of rank 0's is the only line); returns
    its exit status."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"{command}: {said(e)}; {kept}\n".encode())
    return status(e)


def finished():
    """The command's work is done: a stop signal from now on (as the interpreter shuts down) is
    ignored, where it would raise inside an exit handler and print a traceback."""
    for signum in STOPS:
        signal.signal(signum, signal.SIG_IGN)
