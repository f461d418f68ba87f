"""
One line of progress on stderr for a long prefill, rewritten in place:

    prefill 4096/16384 tokens, 812 tok/s, ETA 15s

Silent when the stream is not a terminal (a log file, a pipe, --json output) or when disabled, and
silent for a prefill shorter than one update interval, so short prompts print nothing.
"""
import sys
import time


class Progress:
    def __init__(self, what="prefill", stream=None, enabled=True, interval=0.25,
                 clock=time.monotonic):
        self.what = what
        self.interval = interval
        self.clock = clock
        self.stream = sys.stderr if stream is None else stream
        # \r on a file or a pipe would leave a mess, not a line
        self.enabled = enabled and self.stream.isatty()
        self.start = self.last = clock()
        self.width = 0  # length of the line on screen, so a shorter line can blank out its tail

    def update(self, done, total):
        """Report `done` of `total` tokens; draws at most once per interval,
        and the last step if any was drawn."""
        if not self.enabled:
            return
        now = self.clock()
        finished = done >= total
        if now - self.last < self.interval and not (finished and self.width):
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        eta = f", ETA {duration((total - done) / rate)}" if rate > 0 and not finished else ""
        line = f"{self.what} {done}/{total} tokens, {rate:.0f} tok/s{eta}"
        self.stream.write("\r" + line.ljust(self.width))
        self.width = len(line)
        if finished:
            self.close()
        else:
            self.stream.flush()

    def close(self):
        """End the line (if one was drawn), so that what is printed next starts on a fresh line."""
        if self.width:
            self.stream.write("\n")
            self.stream.flush()
            self.width = 0
        self.enabled = False


def duration(seconds):
    """15s, 4m05s, 2h10m: short enough to fit the line."""
    s = int(seconds + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
