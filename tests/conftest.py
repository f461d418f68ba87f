import faulthandler
import os
import signal
import sys
import tempfile

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
# model.py etc. at the repo root, helpers such as ckpt.py here
sys.path[:0] = [os.path.dirname(TESTS), TESTS]

from ckpt import build_checkpoint  # noqa: E402

# Correctness tests, not benchmarks: one thread keeps small ops fast and immune to a busy second
# core (torch's OpenMP threads can stall for milliseconds per op when another process holds a core).
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"  # and the same for the scripts the tests start


TEST_TIMEOUT_S = 300  # per test; the slowest one takes about a tenth of that on two busy cores


class TimeLimitExceeded(Exception):
    pass


@pytest.fixture(autouse=True)
def per_test_timeout(request):
    """A hang fails its test instead of stalling the suite (pytest-timeout is not a dependency):
    SIGALRM raises in the main thread; if that cannot get through (stuck in C), faulthandler dumps
    every thread's stack and exits."""
    def expire(signum, frame):
        raise TimeLimitExceeded(f"{request.node.nodeid} ran over {TEST_TIMEOUT_S} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_TIMEOUT_S)
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S + 60, exit=True)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session", autouse=True)
def digest_cache(tmp_path_factory):
    """The weights' digest cache (taskdir.DigestCache) goes to a directory of the session's, never
    ~/.cache; the scripts the tests start inherit it."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield os.environ["XDG_CACHE_HOME"]
    if before is None:
        os.environ.pop("XDG_CACHE_HOME")
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir(tmp_path_factory):
    """What the tests, and the processes they start, put in a temporary directory (mkdtemp's,
    torchrun's torchelastic_* logs) goes to a directory of the session's, never /tmp itself: the
    suite leaves nothing there but pytest's own."""
    before, before_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(tmp_path_factory.mktemp("tmpdir"))
    yield os.environ["TMPDIR"]
    tempfile.tempdir = before_dir
    if before is None:
        os.environ.pop("TMPDIR")
    else:
        os.environ["TMPDIR"] = before


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(**build_checkpoint kwargs) -> path, built once per session and shared: never
    modify it (copy it with shutil.copytree first)."""
    built = {}

    def get(**kwargs):
        key = repr(sorted(kwargs.items()))
        if key not in built:
            built[key] = str(build_checkpoint(tmp_path_factory.mktemp("ckpt"), **kwargs))
        return built[key]
    return get


@pytest.fixture(scope="session")
def llama_ckpt(checkpoint):
    """The default tiny Llama (GQA, fp32, one file), shared by the whole session: read only."""
    return checkpoint()


@pytest.fixture(scope="session")
def text_ckpt(tmp_path_factory):
    """A tiny Llama with a sentencepiece tokenizer, for the command-line tools: read only."""
    from ckpt import add_sentencepiece
    path = build_checkpoint(tmp_path_factory.mktemp("text_ckpt"), vocab_size=400,
                            max_position_embeddings=2048)
    return str(add_sentencepiece(path))
