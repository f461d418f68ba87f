"""
Ctrl-C while a command starts: its imports (torch's take seconds) are not a run yet, so the process
says so in one line and ends at once, exit 130. Not by raising: an exception raised inside an
import can leave a module half made (numpy's was seen to), and the command then went on with it
and failed later, or finished after saying it was interrupted. Once its imports are done a command
puts Python's own handler back (started), and its run handles Ctrl-C as it says.
"""
import os
import signal


def starting(command):
    """From now until started(): Ctrl-C ends the process at once with one line naming command."""
    def interrupted(signum, frame):
        os.write(2, f"{command}: interrupted while starting; nothing was kept\n".encode())
        os._exit(130)
    signal.signal(signal.SIGINT, interrupted)


def started():
    """Ctrl-C raises KeyboardInterrupt again, for the run's own handling."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
