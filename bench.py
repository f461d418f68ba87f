"""
`python bench.py`: side-by-side benchmarks, every mode against transformers and llama.cpp
(measure/bench.py). The older spellings `python bench.py --tune ...` and `python bench.py --probe
...` run `python tune.py ...` and `python probe.py ...`.
"""
import sys

if __name__ == "__main__":
    argv = sys.argv[1:]
    try:
        from measure import bench, probe, tune
        main = bench.main
        if "--tune" in argv:
            main = tune.main
        elif "--probe" in argv:
            main = probe.main
        code = main([a for a in argv if a not in ("--tune", "--probe")])
    except KeyboardInterrupt:  # Ctrl-C, even while torch imports: one line and 130
        print("bench.py: interrupted (Ctrl-C); nothing to resume: run it again", file=sys.stderr)
        code = 130
    sys.exit(code)
