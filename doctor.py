"""
The troubleshooting chains of KV offload, checked on this machine for one configuration.

    python doctor.py --ckpt DIR --chunk-size 512 --window 4 --offload disk --offload-dir /nvme/kv --context 32768

One line per symptom, in the order users meet them, "ok" or "FOUND" with the cause and the flag that fixes it:
    device memory never changes (offload not in effect): a context that fits in the window (window >= context in
        chunks, or a chunk as large as the context); an offload directory that cannot be written, or that lives
        in RAM (tmpfs) when the disk tier was meant; a budget smaller than the KV it must hold; a short generation
        that moves no bytes;
    slower than without offload: a storage link (disk read, zstd, host-to-device) below the rate the tier needs
        for --target-tok-s; host memory near swap (MemAvailable against the KV the config puts on the host);
    it does not run: a torch build that does not match the machine (CUDA build without a device, CPU build with
        --device cuda), pinned memory that cannot be registered;
    different output: verify.py's comparison, on a short prompt, with its likely cause (seed, precision, a chunk
        boundary).
Exit 0: nothing found; 1: a cause found; 2: bad usage.
"""
import argparse
import math
import os
import sys

import torch

import probe
import verify
from checkpoint import CheckpointError
from cli import (
    DEMO_CKPT,
    DTYPES,
    UsageError,
    add_common_flags,
    check_common,
    one_line_errors,
    read_model_args,
)
from model import Transformer
from monitor import fmt_bytes, mem_available
from offload import COMPRESSIONS, MODES
from tune import slot

GiB = 2**30


def existing_ancestor(path):
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def fs_type(path, mounts="/proc/mounts"):
    """The file system type of the mount holding `path`, from /proc/mounts (the longest mount point that is a
    prefix of its real path); None where there is no /proc."""
    real, best = os.path.realpath(existing_ancestor(path)), ("", None)
    try:
        with open(mounts) as f:
            for line in f:
                _, mnt, kind = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, kind)
    except OSError:
        pass
    return best[1]


def writable(path):
    """Why `path` cannot be the disk tier's root, or None. Nothing is created: a missing directory is judged by
    its nearest existing ancestor."""
    anc = existing_ancestor(path)
    if not os.path.isdir(anc):
        return f"{anc} is a file, so {path} cannot be created"
    if anc == os.path.abspath(path):
        probe_file = os.path.join(path, f".doctor-{os.getpid()}")
        try:
            open(probe_file, "w").close()
            os.remove(probe_file)
        except OSError as e:
            return f"{path} cannot be written ({e.strerror or e})"
        return None
    return None if os.access(anc, os.W_OK | os.X_OK) else f"{anc} is not writable, so {path} cannot be created"


def pinned_ok(nbytes=1 << 20):
    """Register a small host buffer with the CUDA driver, as the host tier does; the error code, or 0."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
    if rc == 0:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    return rc


# -----------------------------------------------------------------------------
# the checks: each returns (found, symptom, cause or what was checked, fix)

def check_config(a, margs):
    """Offload configured, yet nothing leaves the device: the context fits in the window plus the open chunk."""
    n, C, W = -(-a.context // a.chunk_size), a.chunk_size, a.window
    symptom = "offload not in effect"
    if a.offload == "none":
        return False, symptom, "--offload none: the KV is meant to stay on the device", ""
    if W + 1 < n:
        return False, symptom, f"{n} chunks of {C} per layer, {W} in the window: {n - W - 1} leave the device", ""
    smaller = 1 << max(0, (a.context // (W + 2)).bit_length() - 1)  # a power of two giving >= W + 2 chunks
    cause = (f"--chunk-size {C} is as large as the context ({a.context} tokens): one chunk, never sealed" if n == 1
             else f"the context ({a.context} tokens = {n} chunks of {C}) fits in --window {W} plus the open chunk")
    return True, symptom, cause, f"--window {max(0, n - 2)}" + (f" or --chunk-size {smaller}" if smaller >= 16 else "")


def check_dir(a):
    if a.offload != "disk":
        return [(False, "offload dir", f"--offload {a.offload} does not use it", "")]
    why, kind = writable(a.offload_dir), fs_type(a.offload_dir)
    out = [(why is not None, "offload dir writable", why or f"{a.offload_dir} can be written",
            "--offload-dir DIR on a writable disk (or --offload cpu)")]
    out.append((kind in ("tmpfs", "ramfs"), "offload dir on a disk",
                f"{a.offload_dir} is on {kind or 'an unknown file system'}" + (": the disk tier would live in RAM and "
                "count against host memory" if kind in ("tmpfs", "ramfs") else ""),
                "--offload-dir on a disk-backed file system, or --offload cpu --cpu-budget GiB to say so"))
    return out


def plan_bytes(a, margs):
    """KV bytes at the context: per chunk, offloaded in all, and the part the host holds."""
    L = margs.n_layers
    chunk, n = slot(margs, a, a.chunk_size), -(-a.context // a.chunk_size)
    off = 0 if a.offload == "none" else L * max(0, n - 1 - a.window) * chunk
    budget = a.cpu_budget * GiB if a.cpu_budget is not None else (off if a.offload == "cpu" else 0)
    on_host = off if a.offload == "disk" and fs_type(a.offload_dir) in ("tmpfs", "ramfs") else min(off, budget)
    return chunk, off, on_host


def check_budget(a, margs):
    chunk, off, _ = plan_bytes(a, margs)
    symptom = "budget smaller than the KV"
    if a.offload == "cpu" and a.cpu_budget is not None and a.cpu_budget * GiB < off:
        return True, symptom, (f"--cpu-budget {a.cpu_budget:g} GiB holds {int(a.cpu_budget * GiB) // chunk} of the "
                               f"{off // chunk} chunks offloaded at {a.context} tokens ({fmt_bytes(off)})"), \
            f"--cpu-budget {math.ceil(off / GiB * 1e4) / 1e4:g} or --offload disk"
    if a.offload == "disk":
        free = os.statvfs(existing_ancestor(a.offload_dir))
        free = free.f_bavail * free.f_frsize
        if free < off:
            return True, symptom, f"the disk tier needs {off / GiB:.2f} GiB, {a.offload_dir} has {free / GiB:.2f} " \
                "GiB free", "--offload-dir on a larger disk, or a larger --window"
    return False, symptom, f"the offloaded KV ({fmt_bytes(off)}) fits where it goes", ""


def check_host_memory(a, margs):
    _, _, on_host = plan_bytes(a, margs)
    avail = mem_available()
    found = on_host > 0.8 * avail
    return found, "host memory near swap", f"the config puts {fmt_bytes(on_host)} of KV in host memory, " \
        f"MemAvailable is {fmt_bytes(avail)}", f"--offload disk with --cpu-budget {0.5 * avail / GiB:.1f} or less"


def check_torch(a):
    out, cuda_wanted = [], probe.is_cuda(a.device)
    if torch.version.cuda and not torch.cuda.is_available():
        out.append((True, "torch/CUDA match", f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but "
                    "sees no device (driver, CUDA_VISIBLE_DEVICES)", "--device cpu, or repair the driver"))
    elif cuda_wanted and not torch.version.cuda:
        out.append((True, "torch/CUDA match", f"--device {a.device} with a CPU build of torch {torch.__version__}",
                    "--device cpu, or install a CUDA build of torch"))
    else:
        out.append((False, "torch/CUDA match", f"torch {torch.__version__}, CUDA build {torch.version.cuda}, "
                    f"device usable: {torch.cuda.is_available()}", ""))
    if cuda_wanted and torch.cuda.is_available():
        rc = pinned_ok()
        out.append((rc != 0, "pinned memory", f"cudaHostRegister of 1 MiB returned {rc}" if rc else
                    "1 MiB registered and released", "a smaller --cpu-budget, or raise ulimit -l"))
    else:
        out.append((False, "pinned memory", "not used on CPU", ""))
    return out


def check_run(a, model, margs, skip):
    """A short greedy generation, --offload none and the configuration, on random ids long enough to fill the
    window and offload two chunks: bytes moving, and verify.py's comparison. skip: why it cannot run, or None."""
    if skip:
        return [(True, "bytes moving", f"the short run was skipped: {skip}", "the fix above"),
                (False, "same output with offload on and off", "not compared (the short run was skipped)", "")]
    n = min((a.window + 2) * a.chunk_size + 1, margs.max_context - a.max_new_tokens)
    ids = torch.randint(3, margs.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    try:
        base = verify.run_mode(model, ids, a.max_new_tokens, a.chunk_size, "none", "none", a)
        run = verify.run_mode(model, ids, a.max_new_tokens, a.chunk_size, a.offload, a.compress, a)
    except Exception as e:  # what the user's run would meet: reported as the cause, one line
        return [(True, "bytes moving", f"a short run with this configuration failed: {e}", "the cause it names"),
                (False, "same output with offload on and off", "not compared (the short run failed)", "")]
    st, out = run[2], []
    b, c = st["bytes"], st["chunks"]
    left, moved = c["host"] + c["disk"], b["d2h"] + b["disk_write"] + b["h2d"] + b["disk_read"] + b["disk_mapped_read"]
    if a.offload == "none":
        out.append((False, "bytes moving", "--offload none: no bytes are meant to move", ""))
    else:
        out.append((left == 0 or moved == 0, "bytes moving", f"{n} tokens, chunks device/host/disk "
                    f"{c['device']}/{c['host']}/{c['disk']}, bytes d2h {b['d2h']} h2d {b['h2d']} disk write "
                    f"{b['disk_write']} read {b['disk_read']} read in place {b['disk_mapped_read']}",
                    "a --window or --chunk-size that offloads (see above)"))
    diff = verify.compare(base, run)
    if diff is None:
        out.append((False, "same output with offload on and off", f"{a.offload} is bit-identical to none on {n} "
                    "tokens (if your outputs differ, compare with the same --seed and --temperature, --chunk-size "
                    "and --dtype: a different chunk size or dtype rounds differently)", ""))
    else:
        step, pos, phase, what = diff
        boundary = phase == "decode" and pos is not None and pos % a.chunk_size in (0, a.chunk_size - 1)
        likely = (f"position {pos} is at a chunk boundary: the seal or window eviction logic" if boundary else
                  f"--dtype {a.dtype}: precision mixed across tiers" if a.dtype != "fp32" else
                  "a chunk stitched in at the wrong position, or read from a stale slot (a missing stream wait)")
        out.append((True, "same output with offload on and off", f"step {step} ({phase}, position {pos}): {what}; "
                    f"likely cause: {likely}", "--offload none until fixed; report it with python verify.py"))
    return out


def check_link(a, model, margs, skip):
    """The rate the tier must deliver for --target-tok-s: the offloaded KV at the context, once per decode step."""
    _, off, _ = plan_bytes(a, margs)
    need, cuda, rates = off * a.target_tok_s / probe.GB, probe.is_cuda(a.device), {}
    symptom = "storage link fast enough"
    if off == 0:
        return False, symptom, "nothing is offloaded at this context", ""
    if a.offload == "disk":
        if skip:
            return False, symptom, f"disk not measured: {skip}", ""
        rates["disk read (cold)"] = probe.disk_bandwidth(a.offload_dir, a.probe_mib << 20)["read"]
        if a.compress == "zstd":
            z = probe.zstd_on_real_kv(model, a.chunk_size)
            rates["zstd decompress"] = z["decompress_gbps"]
            rates["disk read (cold)"] *= z["ratio"]  # the disk moves compressed bytes
    if cuda:
        rates["pinned H2D"] = probe.link_bandwidth(a.device)["h2d_pinned"]
    if not rates:
        return False, symptom, "--offload cpu on CPU: chunks are read in place, nothing crosses a link", ""
    name, rate = min(rates.items(), key=lambda kv: kv[1])
    return rate < need, symptom, (f"{name} {rate:.2f} GB/s; {a.target_tok_s:g} tok/s at {a.context} tokens moves "
                                  f"{fmt_bytes(off)} per step: {need:.2f} GB/s needed"), \
        ("--window larger, --offload cpu with a --cpu-budget that holds it" + (", no --compress" if a.compress ==
         "zstd" else "") + ", or --offload-dir on NVMe")


# -----------------------------------------------------------------------------
# command line

def build_parser():
    p = argparse.ArgumentParser(prog="doctor.py", description=__doc__,
                                epilog="alias: python verify.py --diagnose ... runs python doctor.py ...",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(p, chunk_size=512, window=4)
    p.add_argument("--offload", choices=MODES, default="disk", help="the tier to diagnose (default %(default)s)")
    p.add_argument("--compress", choices=COMPRESSIONS, default="none", help="compress disk chunks (lossless)")
    p.add_argument("--context", type=int, help="the context you run at, in tokens (default: 8192 or the model's "
                   "maximum, whichever is less)")
    p.add_argument("--target-tok-s", type=float, default=10.0, help="decode speed the storage link is judged "
                   "against (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens of the short run (default %(default)s)")
    p.add_argument("--probe-mib", type=int, default=64, help="size of the disk test file (default %(default)s MiB)")
    return one_line_errors(p)


def main(argv=None):
    a = build_parser().parse_args(argv)
    device_ok = not probe.is_cuda(a.device) or torch.cuda.is_available()
    try:
        a.ckpt = a.ckpt or DEMO_CKPT
        if not os.path.isdir(a.ckpt):
            raise UsageError(f"--ckpt {a.ckpt}: no such directory")
        if min(a.max_new_tokens, a.probe_mib // 8, a.context or 1) < 1 or a.target_tok_s <= 0:
            raise UsageError("--max-new-tokens, --context and --target-tok-s must be > 0 and --probe-mib >= 8")
        if a.compress == "zstd" and a.offload != "disk":
            raise UsageError("--compress zstd applies to the disk tier; add --offload disk")
        device = a.device
        a.device = a.device if device_ok else "cpu"  # a torch/CUDA mismatch is a finding, not a usage error
        check_common(a, needs_disk=False)
        a.device = device
        margs = read_model_args(a.ckpt)
        a.context = a.context or min(8192, margs.max_context)
        if a.threads:
            torch.set_num_threads(a.threads)
        model = Transformer.from_pretrained(a.ckpt, device=a.device if device_ok else "cpu", dtype=DTYPES[a.dtype])
    except (UsageError, CheckpointError) as e:
        print(f"doctor.py: error: {e}", file=sys.stderr)
        return 2
    findings = [check_config(a, margs), *check_dir(a), check_budget(a, margs), *check_torch(a)]
    blocked = next((cause for found, symptom, cause, _ in findings if found and symptom == "offload dir writable"),
                   None)
    made = a.offload == "disk" and not blocked and not os.path.exists(a.offload_dir)
    if made:
        os.makedirs(a.offload_dir, mode=0o700)
    try:
        if not device_ok:
            a.device = "cpu"
        findings += check_run(a, model, margs, blocked)
        findings += [check_link(a, model, margs, blocked), check_host_memory(a, margs)]
    finally:
        if made:
            try:
                os.rmdir(a.offload_dir)
            except OSError:
                pass
    print(f"{a.ckpt}: --offload {a.offload}{' --compress zstd' if a.compress == 'zstd' else ''} --chunk-size "
          f"{a.chunk_size} --window {a.window} at {a.context} tokens, {a.device} {a.dtype}")
    for found, symptom, cause, fix in findings:
        print(f"{'FOUND' if found else 'ok':<6} {symptom}: {cause}" + (f"; fix: {fix}" if found else ""))
    return 1 if any(f[0] for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
