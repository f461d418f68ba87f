"""
`python tune.py`: chunk size, window, tier, compression and staging slots for a checkpoint and a
context, measured within your budgets (measure/tune.py).
"""
import sys

if __name__ == "__main__":
    from measure import tune
    sys.exit(tune.main())
