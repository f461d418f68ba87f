"""
`python doctor.py`: the troubleshooting chains of docs/tuning.md checked on this machine, for one
configuration (measure/doctor.py). `python verify.py --diagnose ...` runs it too.
"""
import sys

if __name__ == "__main__":
    try:
        from measure import doctor
        code = doctor.main()
    except KeyboardInterrupt:  # Ctrl-C, even while torch imports: one line and 130
        print("doctor.py: interrupted (Ctrl-C); nothing to resume: run it again", file=sys.stderr)
        code = 130
    sys.exit(code)
