"""
tools/plot_trace.py on a small trace: a run's {"run_start"} event is skipped, a task keeps one
colour in every panel, and the legends name each task and each quantity once. Skipped where
matplotlib is not installed (requirements-dev.txt installs it; the tool itself keeps it
optional).
"""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_tool():
    spec = importlib.util.spec_from_file_location("plot_trace",
                                                  os.path.join(ROOT, "tools", "plot_trace.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step(task, t):
    moved = {"h2d": 0, "d2h": 1 << 20, "disk_write": 0, "disk_read": 0, "disk_mapped_read": t << 20}
    return {"t": t, "task": task, "phase": "decode", "position": t, "device_allocated": 1 << 20,
            "device_peak": 1 << 20, "host_rss": 300 << 20, "host_anon": 200 << 20,
            "bytes": moved, "chunks": {"device": 2, "host": 0, "disk": t}}


def test_one_colour_per_task_and_short_legends(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    trace = tmp_path / "trace.jsonl"
    events = [{"t": 0, "run_start": {"pid": 1, "argv": []}}]
    events += [step(task, t) for task in ("a", "b") for t in range(1, 4)]
    events.append({"t": 2, "task": "b", "alert": "slow_task", "message": "slow"})
    trace.write_text("".join(json.dumps(e) + "\n" for e in events))
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    assert load_tool().main([str(trace), "-o", str(tmp_path / "t.png")]) == 0
    panels = saved[0].axes
    assert len(panels) == 3
    colours = []
    for ax in panels:  # the data lines, task by task (alerts are vertical marks of their own)
        lines = [line for line in ax.get_lines() if len(line.get_xdata()) == 3]
        per_task = len(lines) // 2
        colours.append([{line.get_color() for line in lines[i * per_task:(i + 1) * per_task]}
                        for i in range(2)])
    for task in range(2):
        assert len(set.union(*[c[task] for c in colours])) == 1, colours
    assert colours[0][0] != colours[0][1]
    legends = [[text.get_text() for text in ax.get_legend().get_texts()] for ax in panels]
    assert legends == [["task a", "task b"], ["rss", "anon"],
                       ["d2h", "h2d", "disk write", "disk read", "read in place"]]


def test_the_image_is_written_as_the_project_writes_files(tmp_path, capsys):
    """-o through a link: the link is replaced, its target untouched (it was overwritten), the
    image private (0644 before); a format matplotlib lacks and a trace that is not UTF-8 are one
    sentence each (tracebacks)."""
    pytest.importorskip("matplotlib")
    tool = load_tool()
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(step("a", t)) + "\n" for t in range(1, 4)))
    target = tmp_path / "target.txt"
    target.write_text("keep me")
    link = tmp_path / "out.png"
    os.symlink(target, link)
    assert tool.main([str(trace), "-o", str(link)]) == 0
    assert target.read_text() == "keep me" and not os.path.islink(link)
    with open(link, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.stat(link).st_mode & 0o777 == 0o600
    capsys.readouterr()
    assert tool.main([str(trace), "-o", str(tmp_path / "x.txt")]) == 2
    assert "cannot write .txt images" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_bytes(b"\xff\xfe not text")
    assert tool.main([str(tmp_path / "bad.jsonl")]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
