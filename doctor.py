"""
`python doctor.py`: the troubleshooting chains of docs/tuning.md checked on this machine, for one
configuration (measure/doctor.py). `python verify.py --diagnose ...` runs it too.
"""
import sys

if __name__ == "__main__":
    from measure import doctor
    sys.exit(doctor.main())
