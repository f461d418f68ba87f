r"""
The troubleshooting chains of KV offload, checked on this machine for one configuration.

    python doctor.py --ckpt DIR --chunk-size 512 --window 4 --offload disk --offload-dir /nvme/kv \
        --context 32768

One line per symptom, in the order users meet them: "FOUND" with the cause and the flag that fixes
it, or "ok ... not found" with what was checked:
    device memory never changes (offload not in effect): a context that fits in the window (window
        >= context in chunks, or a chunk as large as the context); an offload directory that cannot
        be written, or that lives in RAM (tmpfs) when the disk tier was meant; a budget smaller than
        the KV it must hold; a short generation that moves no bytes;
    slower than without offload: a storage link (disk read, zstd, host-to-device) below the rate the
        tier needs for --target-tok-s; host memory near swap (MemAvailable against the KV the config
        puts on the host);
    it does not run: a torch build that does not match the machine (CUDA build without a device, CPU
        build with --device cuda), pinned memory that cannot be registered;
    different output: verify.py's comparison, on a short prompt, with its likely cause (seed,
        precision, a chunk boundary).
Exit 0: nothing found; 1: a cause found; 2: bad usage.
"""
import argparse
import math
import os
import sys

import torch

import verify
from checkpoint import CheckpointError
from measure import probe
from measure.tune import slot
from model import Transformer
from offload import COMPRESSIONS, MODES, OffloadConfig
from policy import plan_tiers
from private import PrivateError, create_private, dir_problem, make_private_dir
from runs.flags import (
    DEMO_CKPT,
    DTYPES,
    UsageError,
    add_common_flags,
    check_ckpt_dir,
    check_common,
    one_line_errors,
    policy_fields,
    read_model_args,
    select_fields,
    set_threads,
)
from runs.monitor import fmt_bytes, mem_available

GiB = 2**30
IN_RAM = ("tmpfs", "ramfs")  # file systems whose files live in memory
ALIAS = "alias: python verify.py --diagnose ... runs python doctor.py ..."


def existing_ancestor(path):
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def fs_type(path, mounts="/proc/mounts"):
    """The file system type of the mount holding `path`, from /proc/mounts (the longest mount point
    that is a prefix of its real path); None where there is no /proc."""
    real = os.path.realpath(existing_ancestor(path))
    best = ("", None)
    try:
        with open(mounts) as f:
            for line in f:
                _, mnt, kind = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, kind)
    except OSError:
        pass
    return best[1]


def writable(path):
    """Why `path` cannot be the disk tier's root, or None. Nothing is created: a missing directory
    is judged by its nearest existing ancestor."""
    anc = existing_ancestor(path)
    if not os.path.isdir(anc):
        return f"{anc} is a file, so {path} cannot be created"
    if anc == os.path.abspath(path):
        problem = dir_problem(os.lstat(path))  # generate.py refuses what is not private
        if problem:
            return f"{path} {problem}"
        try:  # a new private file under a random name: nothing planted is opened
            fd, probe_file = create_private(path, ".doctor-")
            os.close(fd)
            os.remove(probe_file)
        except (OSError, PrivateError) as e:
            return f"{path} cannot be written ({getattr(e, 'strerror', None) or e})"
        return None
    if os.access(anc, os.W_OK | os.X_OK):
        return None
    return f"{anc} is not writable, so {path} cannot be created"


def pinned_ok(nbytes=1 << 20):
    """Register a small host buffer with the CUDA driver, as the host tier does: 0, or the error."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
    if rc == 0:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    return rc


# -----------------------------------------------------------------------------
# the checks: each returns (found, symptom, cause or what was checked, fix); a symptom names the
# fault, so that "ok     <symptom>: not found" reads as good news

def check_config(args, model_args):
    """Offload configured, yet nothing leaves the device: the context fits in the window plus the
    open chunk."""
    C = args.chunk_size
    W = args.window
    tiers, _ = plan(args, model_args)
    n = tiers.per_layer
    symptom = "offload not in effect"
    if args.offload == "none":
        return False, symptom, "--offload none: the KV is meant to stay on the device", ""
    if tiers.offloaded:
        leave = tiers.offloaded // model_args.n_layers
        checked = f"{n} chunks of {C} per layer, {W} in the window: {leave} leave the device"
        return False, symptom, checked, ""
    # the largest power of two that gives at least W + 2 chunks
    smaller = 1 << max(0, (args.context // (W + 2)).bit_length() - 1)
    if n == 1:
        cause = (f"--chunk-size {C} is as large as the context ({args.context} tokens): "
                 "one chunk, never sealed")
    else:
        cause = (f"the context ({args.context} tokens = {n} chunks of {C}) fits in --window {W} "
                 "plus the open chunk")
    # one chunk is never sealed, whatever the window: only a smaller chunk helps
    fix = None if n == 1 else f"--window {max(0, n - 2)}"
    if smaller >= 16:
        fix = f"{fix} or --chunk-size {smaller}" if fix else f"--chunk-size {smaller}"
    return True, symptom, cause, fix or "a context of more chunks than --window + 1"


def check_dir(args):
    if args.offload != "disk":
        return [(False, "offload dir not writable", f"--offload {args.offload} does not use it",
                 "")]
    why = writable(args.offload_dir)
    kind = fs_type(args.offload_dir)
    checked = why or f"{args.offload_dir} can be written"
    out = [(why is not None, "offload dir not writable", checked,
            "--offload-dir DIR on a writable disk (or --offload cpu)")]
    cause = f"{args.offload_dir} is on {kind or 'an unknown file system'}"
    if kind in IN_RAM:
        cause += ": the disk tier would live in RAM and count against host memory"
    fix = "--offload-dir on a disk-backed file system, or --offload cpu --cpu-budget GiB to say so"
    out.append((kind in IN_RAM, "offload dir in RAM", cause, fix))
    return out


def plan(args, model_args):
    """Where the chunks of --context positions go under this configuration (policy.plan_tiers),
    and the bytes of one chunk as the tiers allocate it."""
    chunk = slot(model_args, args, args.chunk_size)
    host_slots = None  # the policy's default: all of --offload cpu, none of --offload disk
    if args.cpu_budget is not None:
        host_slots = int(args.cpu_budget * GiB) // chunk
    tiers = plan_tiers(args.context, args.chunk_size, args.window, model_args.n_layers,
                       args.offload, host_slots)
    return tiers, chunk


def plan_bytes(args, model_args):
    """KV bytes at the context: per chunk, offloaded in all, and the part the host holds."""
    tiers, chunk = plan(args, model_args)
    off = tiers.offloaded * chunk
    if args.offload == "disk" and fs_type(args.offload_dir) in IN_RAM:
        on_host = off  # the disk tier's files are in memory too
    else:
        on_host = tiers.host * chunk
    return chunk, off, on_host


def check_budget(args, model_args):
    tiers, chunk = plan(args, model_args)
    off = tiers.offloaded * chunk
    symptom = "budget smaller than the KV"
    if tiers.unplaced:
        cause = (f"--cpu-budget {args.cpu_budget:g} GiB holds {tiers.host} of the "
                 f"{tiers.offloaded} chunks offloaded at {args.context} tokens ({fmt_bytes(off)})")
        fix = f"--cpu-budget {math.ceil(off / GiB * 1e4) / 1e4:g} or --offload disk"
        return True, symptom, cause, fix
    if args.offload == "disk":
        free = os.statvfs(existing_ancestor(args.offload_dir))
        free = free.f_bavail * free.f_frsize
        if free < off:
            cause = (f"the disk tier needs {off / GiB:.2f} GiB, {args.offload_dir} has "
                     f"{free / GiB:.2f} GiB free")
            return True, symptom, cause, "--offload-dir on a larger disk, or a larger --window"
    return False, symptom, f"the offloaded KV ({fmt_bytes(off)}) fits where it goes", ""


def check_host_memory(args, model_args):
    _, _, on_host = plan_bytes(args, model_args)
    avail = mem_available()
    cause = (f"the config puts {fmt_bytes(on_host)} of KV in host memory, MemAvailable is "
             f"{fmt_bytes(avail)}")
    fix = f"--offload disk with --cpu-budget {0.5 * avail / GiB:.1f} or less"
    return on_host > 0.8 * avail, "host memory near swap", cause, fix


def check_torch(args):
    out = []
    cuda_wanted = probe.is_cuda(args.device)
    if torch.version.cuda and not torch.cuda.is_available():
        cause = (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no "
                 "device (driver, CUDA_VISIBLE_DEVICES)")
        out.append((True, "torch/CUDA mismatch", cause, "--device cpu, or repair the driver"))
    elif cuda_wanted and not torch.version.cuda:
        cause = f"--device {args.device} with a CPU build of torch {torch.__version__}"
        fix = "--device cpu, or install a CUDA build of torch"
        out.append((True, "torch/CUDA mismatch", cause, fix))
    else:
        checked = (f"torch {torch.__version__}, CUDA build {torch.version.cuda}, device usable: "
                   f"{torch.cuda.is_available()}")
        out.append((False, "torch/CUDA mismatch", checked, ""))
    if cuda_wanted and torch.cuda.is_available():
        rc = pinned_ok()
        if rc:
            cause = f"cudaHostRegister of 1 MiB returned {rc}"
        else:
            cause = "1 MiB registered and released"
        out.append((rc != 0, "pinned memory refused", cause,
                    "a smaller --cpu-budget, or raise ulimit -l"))
    else:
        out.append((False, "pinned memory refused", "not used on CPU", ""))
    return out


def check_run(args, model, model_args, skip):
    """A short greedy generation, --offload none and the configuration, on random ids long enough to
    fill the window and offload two chunks: bytes moving, and verify.py's comparison. skip: why it
    cannot run, or None."""
    same = "different output with offload on and off"
    if skip:
        return [(True, "no bytes moving", f"the short run was skipped: {skip}", "the fix above"),
                (False, same, "not compared (the short run was skipped)", "")]
    n = min((args.window + 2) * args.chunk_size + 1, model_args.max_context - args.max_new_tokens)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model_args.vocab_size, (n,), generator=g).tolist()
    max_new = args.max_new_tokens
    C = args.chunk_size
    try:
        # with the run's own --select (every mode reads what it picks) and --placement
        cfg = OffloadConfig(mode=args.offload, window=args.window, offload_dir=args.offload_dir,
                            compress=args.compress, cpu_budget_gib=args.cpu_budget,
                            staging_slots=args.staging_slots,
                            group_buffers=args.group_buffers, **policy_fields(args))
        base = verify.run_mode(model, ids, max_new, C,
                               OffloadConfig(window=args.window, **select_fields(args)),
                               args.kv_dtype)
        run = verify.run_mode(model, ids, max_new, C, cfg, args.kv_dtype)
    except Exception as e:  # what the user's run would meet: reported as the cause, one line
        return [(True, "no bytes moving", f"a short run with this configuration failed: {e}",
                 "the cause it names"),
                (False, same, "not compared (the short run failed)", "")]
    out = []
    b = run[2]["bytes"]
    c = run[2]["chunks"]
    left = c["host"] + c["disk"]
    moved = b["d2h"] + b["disk_write"] + b["h2d"] + b["disk_read"] + b["disk_mapped_read"]
    if args.offload == "none":
        out.append((False, "no bytes moving", "--offload none: no bytes are meant to move", ""))
    else:
        size = {k: fmt_bytes(v) for k, v in b.items()}
        checked = (f"{n} tokens, chunks device/host/disk {c['device']}/{c['host']}/{c['disk']}, "
                   f"d2h {size['d2h']}, h2d {size['h2d']}, disk write {size['disk_write']}, "
                   f"read {size['disk_read']}, read in place {size['disk_mapped_read']}")
        out.append((left == 0 or moved == 0, "no bytes moving", checked,
                    "a --window or --chunk-size that offloads (see above)"))
    diff = verify.compare(base, run)
    if diff is None:
        checked = (f"{args.offload} is bit-identical to none on {n} tokens (if your outputs "
                   "differ, compare with the same --seed and --temperature, --chunk-size and "
                   "--dtype: a different chunk size or dtype rounds differently)")
        out.append((False, same, checked, ""))
        return out
    step, pos, phase, what = diff
    edge = (0, args.chunk_size - 1)
    boundary = phase == "decode" and pos is not None and pos % args.chunk_size in edge
    if boundary:
        likely = f"position {pos} is at a chunk boundary: the seal or window eviction logic"
    elif args.dtype != "fp32":
        likely = f"--dtype {args.dtype}: precision mixed across tiers"
    else:
        likely = ("a chunk stitched in at the wrong position, or read from a stale slot "
                  "(a missing stream wait)")
    cause = f"step {step} ({phase}, position {pos}): {what}; likely cause: {likely}"
    out.append((True, same, cause, "--offload none until fixed; report it with python verify.py"))
    return out


def check_link(args, model, model_args, skip):
    """The rate the tier must deliver for --target-tok-s: the offloaded KV at the context, once per
    decode step."""
    _, off, _ = plan_bytes(args, model_args)
    need = off * args.target_tok_s / probe.GB
    rates = {}
    symptom = "storage link too slow"
    if off == 0:
        return False, symptom, "nothing is offloaded at this context", ""
    if args.offload == "disk":
        if skip:
            return False, symptom, f"disk not measured: {skip}", ""
        try:
            disk = probe.disk_bandwidth(args.offload_dir, args.probe_mib << 20)
        except OSError as e:  # a full disk is the finding, not the doctor's end
            return (True, symptom, f"{args.offload_dir} cannot hold the probe's "
                    f"{args.probe_mib} MiB ({e.strerror})",
                    "free space there, or another --offload-dir (or a smaller --probe-mib)")
        rates["disk read (cold)"] = disk["read"]
        if args.compress == "zstd":
            z = probe.zstd_on_real_kv(model, args.chunk_size)
            rates["zstd decompress"] = z["decompress_gbps"]
            rates["disk read (cold)"] *= z["ratio"]  # the disk moves compressed bytes
    if probe.is_cuda(args.device):
        rates["pinned H2D"] = probe.link_bandwidth(args.device)["h2d_pinned"]
    if not rates:
        checked = "--offload cpu on CPU: chunks are read in place, nothing crosses a link"
        return False, symptom, checked, ""
    name = min(rates, key=rates.get)
    rate = rates[name]
    checked = (f"{name} {rate:.2f} GB/s; {args.target_tok_s:g} tok/s at {args.context} tokens "
               f"moves {fmt_bytes(off)} per step: {need:.2f} GB/s needed")
    fix = "--window larger, --offload cpu with a --cpu-budget that holds it"
    if args.compress == "zstd":
        fix += ", no --compress"
    fix += ", or --offload-dir on NVMe"
    return rate < need, symptom, checked, fix


# -----------------------------------------------------------------------------
# command line

def build_parser():
    p = argparse.ArgumentParser(prog="doctor.py", description=__doc__, epilog=ALIAS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(p, chunk_size=512, window=4)
    p.add_argument("--offload", choices=MODES, default="disk",
                   help="the tier to diagnose (default %(default)s)")
    p.add_argument("--compress", choices=COMPRESSIONS, default="none",
                   help="compress disk chunks (lossless)")
    p.add_argument("--context", type=int,
                   help="the context you run at, in tokens (default: 8192 or the model's maximum, "
                   "whichever is less)")
    p.add_argument("--target-tok-s", type=float, default=10.0,
                   help="decode speed the storage link is judged against (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=8,
                   help="tokens of the short run (default %(default)s)")
    p.add_argument("--probe-mib", type=int, default=64,
                   help="size of the disk test file (default %(default)s MiB)")
    return one_line_errors(p)


def main(argv=None):
    args = build_parser().parse_args(argv)
    device_ok = not probe.is_cuda(args.device) or torch.cuda.is_available()
    try:
        args.ckpt = args.ckpt or DEMO_CKPT
        check_ckpt_dir(args.ckpt)
        context_ok = args.context is None or args.context >= 1
        positive = context_ok and min(args.max_new_tokens, args.probe_mib // 8) >= 1
        if not positive or not 0 < args.target_tok_s < math.inf:  # nan is refused too
            raise UsageError("--max-new-tokens, --context and --target-tok-s must be > 0 and "
                             "--probe-mib >= 8")
        if args.compress == "zstd" and args.offload != "disk":
            raise UsageError("--compress zstd applies to the disk tier; add --offload disk")
        device = args.device
        # a torch/CUDA mismatch is a finding, not a usage error
        args.device = args.device if device_ok else "cpu"
        check_common(args, needs_disk=False)
        args.device = device
        model_args = read_model_args(args.ckpt)
        args.context = args.context or min(8192, model_args.max_context)
        if args.context > model_args.max_context:
            raise UsageError(f"--context {args.context} is past the model's maximum context of "
                             f"{model_args.max_context} positions; give at most that")
        set_threads(args)  # cores.py: the cores this run may use
        model = Transformer.from_pretrained(args.ckpt, device=args.device if device_ok else "cpu",
                                            dtype=DTYPES[args.dtype])
    except (UsageError, CheckpointError) as e:
        print(f"doctor.py: error: {e}", file=sys.stderr)
        return 2
    findings = [check_config(args, model_args), *check_dir(args), check_budget(args, model_args),
                *check_torch(args)]
    blocked = next((cause for found, symptom, cause, _ in findings
                    if found and symptom == "offload dir not writable"), None)
    made = args.offload == "disk" and not blocked and not os.path.exists(args.offload_dir)
    if made:
        make_private_dir(args.offload_dir, "--offload-dir")  # 0700, and so are missing parents
    try:
        if not device_ok:
            args.device = "cpu"
        findings += check_run(args, model, model_args, blocked)
        findings.append(check_link(args, model, model_args, blocked))
        findings.append(check_host_memory(args, model_args))
    finally:
        if made:
            try:
                os.rmdir(args.offload_dir)
            except OSError:
                pass
    compress = " --compress zstd" if args.compress == "zstd" else ""
    print(f"{args.ckpt}: --offload {args.offload}{compress} --chunk-size {args.chunk_size} "
          f"--window {args.window} at {args.context} tokens, {args.device} {args.dtype}")
    for found, symptom, cause, fix in findings:
        if found:
            print(f"FOUND  {symptom}: {cause}; fix: {fix}")
        else:  # what was checked, after the symptom that was not found
            print(f"ok     {symptom}: not found ({cause})")
    return 1 if any(f[0] for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
