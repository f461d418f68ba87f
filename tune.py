"""
`python tune.py`: chunk size, window, tier, compression and staging slots for a checkpoint and a
context, measured within your budgets (measure/tune.py).
"""
import sys

if __name__ == "__main__":
    from runs import interrupt
    interrupt.starting("tune.py")  # Ctrl-C while torch imports: one line, exit 130
    try:
        from measure import tune
        interrupt.started()
        code = tune.main()
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or SIGHUP once started: one line
        code = interrupt.ended("tune.py", e)
    except BrokenPipeError:  # `| head`: one line and 141
        code = interrupt.closed_stdout("tune.py")
    interrupt.finished()  # a stop signal during shutdown: ignored, never a traceback
    sys.exit(code)
