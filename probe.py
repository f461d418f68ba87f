"""
`python probe.py`: this machine's links, disk and zstd, and what each offload mode's decode would
cost here (measure/probe.py). Step 1 of docs/checklist.md.
"""
import sys

if __name__ == "__main__":
    from runs import interrupt
    interrupt.starting("probe.py")  # Ctrl-C while torch imports: one line, exit 130
    try:
        from measure import probe
        interrupt.started()
        code = probe.main()
    except KeyboardInterrupt:  # Ctrl-C once started: one line and 130
        print("probe.py: interrupted (Ctrl-C); nothing to resume: run it again", file=sys.stderr)
        code = 130
    except BrokenPipeError:  # `| head`: one line and 141
        code = interrupt.closed_stdout("probe.py")
    sys.exit(code)
