"""
`python probe.py`: this machine's links, disk and zstd, and what each offload mode's decode would
cost here (measure/probe.py). Step 1 of docs/checklist.md.
"""
import sys

if __name__ == "__main__":
    try:
        from measure import probe
        code = probe.main()
    except KeyboardInterrupt:  # Ctrl-C, even while torch imports: one line and 130
        print("probe.py: interrupted (Ctrl-C); nothing to resume: run it again", file=sys.stderr)
        code = 130
    sys.exit(code)
