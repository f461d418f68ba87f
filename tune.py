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
    except KeyboardInterrupt:  # Ctrl-C once started: one line and 130
        print("tune.py: interrupted (Ctrl-C); nothing to resume: run it again", file=sys.stderr)
        code = 130
    except BrokenPipeError:  # `| head`: one line and 141
        code = interrupt.closed_stdout("tune.py")
    sys.exit(code)
