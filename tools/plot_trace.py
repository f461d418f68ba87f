"""
Draw a trace written by `generate.py --trace TRACE.jsonl`: device memory, host memory and bytes
moved per tier over time, one line per task, alerts as vertical marks.

    python tools/plot_trace.py TRACE.jsonl -o trace.png

matplotlib is an optional dependency: `pip install matplotlib`.
"""
import argparse
import io
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from private import PrivateError, write_atomic  # noqa: E402


def load(path):
    steps, alerts = defaultdict(list), []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                e = json.loads(line)
            except ValueError:
                print(f"{path} line {n}: not JSON; skipped", file=sys.stderr)
                continue
            if "alert" in e:
                alerts.append(e)
            elif "task" in e:  # a step; a run's {"run_start"} event is not drawn
                steps[e["task"]].append(e)
    return steps, alerts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="TRACE.jsonl from generate.py --trace")
    p.add_argument("-o", "--output", default="trace.png", help="image to write (default trace.png)")
    args = p.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        print("plot_trace.py: error: matplotlib is not installed; pip install matplotlib",
              file=sys.stderr)
        return 2
    try:
        steps, alerts = load(args.trace)
    except OSError as e:
        print(f"plot_trace.py: error: {args.trace}: {e.strerror}", file=sys.stderr)
        return 2
    except UnicodeDecodeError:
        print(f"plot_trace.py: error: {args.trace} is not UTF-8 text (a --trace file is)",
              file=sys.stderr)
        return 2
    if not steps:
        print(f"plot_trace.py: error: {args.trace} has no step events", file=sys.stderr)
        return 2
    t0 = min(e["t"] for events in steps.values() for e in events)
    mib = 1 / 2**20
    fig, (ax_dev, ax_host, ax_io) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    # a task keeps one colour in every panel; a line style says which quantity it is
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    host_styles = {"host_rss": "-", "host_anon": "--"}
    io_styles = {"d2h": "-", "h2d": ":", "disk_write": "-.", "disk_read": "--",
                 "disk_mapped_read": (0, (6, 2, 1, 2, 1, 2))}
    tasks = sorted(steps)
    for i, task in enumerate(tasks):
        events = steps[task]
        colour = colours[i % len(colours)]
        t = [e["t"] - t0 for e in events]
        ax_dev.plot(t, [e["device_allocated"] * mib for e in events], color=colour)
        for key, style in host_styles.items():
            ax_host.plot(t, [e[key] * mib for e in events], linestyle=style, color=colour)
        for key, style in io_styles.items():
            ax_io.plot(t, [e["bytes"].get(key, 0) * mib for e in events], linestyle=style,
                       color=colour)
    for a in alerts:
        for ax in (ax_dev, ax_host, ax_io):
            ax.axvline(a["t"] - t0, color="red", alpha=0.4)
    # short legends: the tasks once (colours), each panel's quantities once (styles)
    ax_dev.legend([Line2D([], [], color=colours[i % len(colours)]) for i in range(len(tasks))],
                  [f"task {task}" for task in tasks], fontsize=7, loc="upper left")
    for ax, styles, names in ((ax_host, host_styles, ("rss", "anon")),
                              (ax_io, io_styles, ("d2h", "h2d", "disk write", "disk read",
                                                  "read in place"))):
        ax.legend([Line2D([], [], linestyle=style, color="gray") for style in styles.values()],
                  names, fontsize=7, loc="best", ncol=len(names))
    ax_dev.set_ylabel("device MiB\n(KV on the device)")
    ax_host.set_ylabel("host MiB")
    ax_io.set_ylabel("MiB moved\nper step")
    ax_io.set_xlabel("seconds")
    for ax in (ax_dev, ax_host, ax_io):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{args.trace}: {len(steps)} task(s), {len(alerts)} alert(s)")
    fig.tight_layout()
    # drawn in memory, then written as the project writes files: 0600, a link at the name
    # replaced, never followed
    image = io.BytesIO()
    kind = os.path.splitext(args.output)[1][1:].lower() or "png"
    try:
        fig.savefig(image, dpi=100, format=kind)
    except ValueError:
        print(f"plot_trace.py: error: -o {args.output}: matplotlib cannot write .{kind} images; "
              "name a .png, .svg or .pdf", file=sys.stderr)
        return 2
    try:
        write_atomic(args.output, image.getvalue())
    except (OSError, PrivateError) as e:
        print(f"plot_trace.py: error: -o {args.output}: cannot be written "
              f"({getattr(e, 'strerror', None) or e})", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
