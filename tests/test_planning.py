"""
One planning function (policy.plan_tiers) behind every tool that counts chunks: the tuner, the
doctor, the probe's prediction and the monitor's words all say what a real task's store ends up
holding. The reference is the store itself: a tiny task run through run_task, its stats["chunks"].
"""
from argparse import Namespace

import pytest
import torch

from measure import doctor, probe, tune
from model import Transformer
from offload import OffloadConfig
from runs.monitor import Monitor
from runs.task import run_task

CASES = [  # prompt tokens, new tokens, chunk size, window, --offload, --cpu-budget in chunks
    (70, 6, 16, 1, "disk", None),   # the last position mid-chunk
    (59, 6, 16, 2, "cpu", None),    # the last position written fills a chunk: no open chunk left
    (100, 9, 8, 3, "disk", 5),      # a host tier of 5 chunks in front of the disk
    (40, 4, 16, 4, "disk", None),   # the whole context in the window: nothing leaves
    (33, 3, 8, 0, "cpu", None),     # window 0
    (50, 5, 16, 1, "none", None),
]


@pytest.fixture(scope="module")
def model(checkpoint):
    return Transformer.from_pretrained(checkpoint())


def slot_gib(model, C, slots):
    """A --cpu-budget that holds exactly `slots` aligned chunks of C positions."""
    a = model.args
    chunk = 2 * a.n_kv_heads * C * a.head_dim * 4  # K and V, fp32
    return slots * (-(-chunk // 4096) * 4096) / 2**30


@pytest.mark.parametrize("P, N, C, W, mode, host_chunks", CASES)
def test_every_plan_is_what_the_store_holds(model, tmp_path, P, N, C, W, mode, host_chunks):
    L = model.args.n_layers
    budget = None if host_chunks is None else slot_gib(model, C, host_chunks)
    cfg = OffloadConfig(mode=mode, window=W, cpu_budget_gib=budget, offload_dir=str(tmp_path))
    ids = torch.randint(3, model.args.vocab_size, (P,), generator=torch.Generator().manual_seed(P))
    new, stats = run_task(model, ids.tolist(), N, chunk_size=C, cfg=cfg)
    assert len(new) == N  # no EOS here: every position was reached
    held = stats["chunks"]
    # plain arithmetic: the positions written are the prompt and all but the last new token
    written = P + N - 1
    sealed = written // C
    open_chunks = L if written % C else 0  # a chunk just filled is sealed, no new one opened yet
    assert held["device"] + held["host"] + held["disk"] == L * sealed + open_chunks

    # the tuner's plan for --context P --new-tokens N, in aligned chunks
    args = Namespace(dtype="fp32", kv_dtype="auto", context=P, new_tokens=N)
    c = tune.plan(tune.Candidate(C, W, mode, cpu_budget=budget), model.args, args, cuda=False)
    slot = tune.slot(model.args, args, C)
    if mode == "none":
        assert c.kv["device"] == L * (sealed + 1) * slot
    else:
        assert (c.kv["host"] // slot, c.kv["disk"] // slot) == (held["host"], held["disk"])
        assert c.kv["device"] // slot - L == held["device"] - open_chunks

    # the doctor's, for a run at --context P + N
    d_args = Namespace(chunk_size=C, window=W, context=P + N, offload=mode, cpu_budget=budget,
                       dtype="fp32", kv_dtype="auto", offload_dir=str(tmp_path))
    tiers, _ = doctor.plan(d_args, model.args)
    assert (tiers.device + open_chunks, tiers.host, tiers.disk) == (
        held["device"], held["host"], held["disk"])
    chunk, off, on_host = doctor.plan_bytes(d_args, model.args)
    assert (off, on_host) == ((held["host"] + held["disk"]) * chunk, held["host"] * chunk)

    # the probe's, halfway through decoding 2 (N - 1) tokens: P + N - 1 positions written
    p_args = Namespace(chunk_size=C, window=W, new_tokens=2 * (N - 1))
    half = probe.halfway(P, mode, p_args, model.args)
    assert half.device + half.offloaded == L * sealed
    assert half.offloaded == held["host"] + held["disk"]


def test_the_alert_counts_chunks_per_layer(model, tmp_path):
    """The context that stayed on the device is said in chunks per layer (1 here, on 2 layers), not
    the total across layers."""
    L = model.args.n_layers
    cfg = OffloadConfig(mode="disk", window=4, offload_dir=str(tmp_path))
    ids = list(range(3, 23))
    new, stats = run_task(model, ids, 5, chunk_size=64, cfg=cfg)
    assert stats["chunks"] == {"device": L, "host": 0, "disk": 0}  # one open chunk per layer
    said = []
    Monitor(log=said.append).context_stayed_on_device("t", stats, len(ids) + len(new), 64, 4, L)
    assert len(said) == 1 and "(1 chunk per layer of 64 positions" in said[0], said
