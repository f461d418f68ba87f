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
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or SIGHUP once started: one line
        code = interrupt.ended("probe.py", e)
    except BrokenPipeError:  # `| head`: one line and 141
        code = interrupt.closed_stdout("probe.py")
    interrupt.finished()  # a stop signal during shutdown: ignored, never a traceback
    sys.exit(code)
