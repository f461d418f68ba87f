"""
`python doctor.py`: the troubleshooting chains of docs/tuning.md checked on this machine, for one
configuration (measure/doctor.py). `python verify.py --diagnose ...` runs it too.
"""
import sys

if __name__ == "__main__":
    from runs import interrupt
    interrupt.starting("doctor.py")  # Ctrl-C while torch imports: one line, exit 130
    try:
        from measure import doctor
        interrupt.started()
        code = doctor.main()
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or SIGHUP once started: one line
        code = interrupt.ended("doctor.py", e)
    except BrokenPipeError:  # `| head`: one line and 141
        code = interrupt.closed_stdout("doctor.py")
    interrupt.finished()  # a stop signal during shutdown: ignored, never a traceback
    sys.exit(code)
