"""
`python probe.py`: this machine's links, disk and zstd, and what each offload mode's decode would
cost here (measure/probe.py). Step 1 of docs/checklist.md.
"""
import sys

if __name__ == "__main__":
    from measure import probe
    sys.exit(probe.main())
