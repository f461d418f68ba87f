"""
`python tune.py`: chunk size, window, tier, compression and staging slots for a checkpoint and a
context, measured within your budgets (measure/tune.py).
"""
import sys

if __name__ == "__main__":
    try:
        from measure import tune
        code = tune.main()
    except KeyboardInterrupt:  # Ctrl-C, even while torch imports: one line and 130
        print("tune.py: interrupted (Ctrl-C); nothing to resume: run it again", file=sys.stderr)
        code = 130
    sys.exit(code)
