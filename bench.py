"""
`python bench.py`: side-by-side benchmarks, every mode against transformers and llama.cpp
(measure/bench.py). The older spellings `python bench.py --tune ...` and `python bench.py --probe
...` run `python tune.py ...` and `python probe.py ...`.
"""
import sys

if __name__ == "__main__":
    argv = sys.argv[1:]
    from runs import interrupt
    interrupt.starting("bench.py")  # Ctrl-C while torch imports: one line, exit 130
    try:
        from measure import bench, probe, tune
        interrupt.started()
        main = tune.main if "--tune" in argv else probe.main if "--probe" in argv else bench.main
        code = main([a for a in argv if a not in ("--tune", "--probe")])
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or SIGHUP once started: one line
        code = interrupt.ended("bench.py", e)
    except BrokenPipeError:  # `| head`: one line and 141
        code = interrupt.closed_stdout("bench.py")
    interrupt.finished()  # a stop signal during shutdown: ignored, never a traceback
    sys.exit(code)
