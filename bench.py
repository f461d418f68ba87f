"""
`python bench.py`: side-by-side benchmarks, every mode against transformers and llama.cpp
(measure/bench.py). The older spellings `python bench.py --tune ...` and `python bench.py --probe
...` run `python tune.py ...` and `python probe.py ...`.
"""
import sys

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--tune" in argv:
        from measure import tune
        sys.exit(tune.main([a for a in argv if a != "--tune"]))
    if "--probe" in argv:
        from measure import probe
        sys.exit(probe.main([a for a in argv if a != "--probe"]))
    from measure import bench
    sys.exit(bench.main(argv))
