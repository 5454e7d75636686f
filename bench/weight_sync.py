"""Weight-sync benchmark: per-tensor vs module-grouped buckets into a real `grpo-async serve` server.

What it measures: wall time of one full weight push (trainer state dict → server worker → layerwise reload →
prefix-cache reset), median of `--repeats`, for a tiny Llama made big in *count*: ≥ 300 tensors, ≥ 25 MB float32
(34 layers × 9 tensors + 3). Each transport runs in two modes:

- per-tensor: one HTTP request and one transfer per tensor (what a naive `for name, p in params` loop does; the
  bench's own loop, `per_tensor`: every tensor its own group, under a threshold every group exceeds);
- bucketed:   tensors grouped by module and packed into ~`--bucket-mb` flat uint8 buffers, one request per sync.

Transports: gloo broadcast over a dedicated process group, and POSIX shared memory (same machine).

Two limits, both the same bytes as ONE bucket and one request:
- "flat wire": moved and not loaded (`load=False`): the transport alone, the physical limit of moving the bytes
  (loopback gloo moves ~0.4-0.7 GB/s on this 2-core machine; shared memory is a memcpy).
- "flat loaded": moved and loaded: the limit of any sync, since vLLM's layerwise reload (re-packing every linear
  for oneDNN on CPU) has a cost of its own that no transport removes; the worker's `phases` show it.

How to read the ratios:
- `speedup = per_tensor / bucketed` on the same transport: how much grouping saves. Small tensors are
  overhead-bound (a request + a transfer each, ~5-8 ms), so for ≥ 300 tensors expect ≥ 5×.
- `bucketed / flat_loaded`: the cost of bucketing itself (several buckets instead of one); ≤ 1.5× means the
  buckets cost nothing noticeable. `bucketed / flat_wire`: how far a real sync is from just moving the bytes;
  the gap is `phases["load"]` (vLLM's reload), not the protocol.

GPU variant (`--device cuda`, on a CUDA machine with a CUDA vLLM): the state dict lives on the GPU, the server is a
CUDA vLLM, the transports are NCCL broadcast and CUDA IPC handles; the device name goes into the JSON (`device`).

Delta sync (`GRPOConfig.weight_sync_delta`, `grpo_async/weight_sync/delta.py`): SmolLM2-135M trained in float32
(AdamW on a language-model loss of a fixed batch, no weight decay) at learning rates 1e-6 and 1e-5, published after
every optimizer step through the trainer's own path (`PolicyPublisher` → `VLLMServerBackend`) into a `grpo-async serve`
running **bfloat16** (its own server, started after the one above), over gloo broadcast (the transport of a server on
another machine) and shared memory. Per learning rate: `--delta-steps` delta pushes (after the first, full, one), then
the same final weights pushed whole as today (`delta=False`: float32, what the trainer holds) and whole in the
engine's dtype (`delta=True, full_every=1`). Bytes per sync are what the trainer hands the transport; seconds per sync
are the publish's wall time (reading the live model, coding, moving, the server's checks and vLLM's reload). The
engine's greedy log-probs after the delta pushes must equal, bitwise, those after the full push of the same weights.
`bytes_ratio` = full push in the engine's dtype ÷ delta push (the `RESULT`; ÷ 2 more against today's float32 push).

Run: `python bench/weight_sync.py` (starts and stops its own servers; ~2 min on 2 cores, plus the delta part's
~5 min); `--delta-only`: the delta part alone. Writes `bench/out/weight_sync.json` and ends with `RESULT
weight_sync_speedup=<x>` (bucketed vs per-tensor, broadcast) and `RESULT weight_sync_delta_bytes_ratio=<x>` (at 1e-6,
broadcast).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _runs import launch_bench_server, run_python  # noqa: E402

from grpo_async.generation.server_process import TWO_PROCESS_ENV  # noqa: E402
from grpo_async.net import ServerClient
from grpo_async.testing import TinyModelSpec, build_tiny_model  # noqa: E402
from grpo_async.weight_sync.buckets import group_by_module, iter_buckets  # noqa: E402
from grpo_async.weight_sync.transports import BroadcastTransport, CudaIpcTransport, ShmTransport

SPEC = TinyModelSpec(
    hidden_size=128, intermediate_size=384, num_hidden_layers=34, num_attention_heads=4, num_key_value_heads=4, seed=0
)


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up (first use of a code path, page faults)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


#: a bucket threshold (MiB) below any tensor's size: every group goes alone
PER_TENSOR_MB = 1e-9


def per_tensor(groups: list) -> list:
    """`(module, [(name, tensor)])` groups split into one group per tensor: pushed with `PER_TENSOR_MB`, each
    tensor is its own bucket (one request and one transfer each)."""
    return [(name, [(name, t)]) for _, tensors in groups for name, t in tensors]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "grpo_async_bench_ws_model"))
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: the trainer's tensors on the GPU, a CUDA vLLM server, NCCL broadcast and CUDA IPC transports",
    )
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "weight_sync.json")
    )
    ap.add_argument("--smoke", action="store_true", help="a 2-layer model, 1 repeat: checks the bench runs (seconds)")
    ap.add_argument("--delta-only", action="store_true", help="only the delta-vs-full part (SmolLM2, bf16 server)")
    ap.add_argument("--delta-steps", type=int, default=5, help="delta pushes per learning rate (after a full one)")
    args = ap.parse_args(argv)
    spec = SPEC
    if args.smoke:
        spec = dataclasses.replace(SPEC, num_hidden_layers=2)
        args.repeats, args.bucket_mb, args.delta_steps = 1, 0.25, 2
        args.model_dir = os.path.join(tempfile.gettempdir(), "grpo_async_bench_ws_model_smoke")
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "smoke", "weight_sync.json")

    path = build_tiny_model(args.model_dir, spec)
    results: dict = {"bucket_mb": args.bucket_mb, "repeats": args.repeats}
    results["device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU x{os.cpu_count()}"
    if not args.delta_only:
        legacy(args, path, results)
    if args.device == "cpu" and "delta" not in results:  # (the smoke ran it on its own server already)
        results["delta"] = delta_bench(args, path)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")
    if "broadcast" in results:
        print(f"RESULT weight_sync_speedup={results['broadcast']['speedup']:.2f}")
        print(f"RESULT weight_sync_staging_ratio={results['staging']['ratio']:.3f}")
    if "delta" in results:
        low = results["delta"]["broadcast"][str(DELTA_LRS[0])]
        print(f"RESULT weight_sync_delta_bytes_ratio={low['bytes_ratio']:.2f}")
        print(f"RESULT weight_sync_delta_seconds_ratio={low['seconds_ratio']:.2f}")
        print(f"RESULT weight_sync_delta_bitwise={int(results['delta']['bitwise'])}")
    return results


def legacy(args, path: str, results: dict) -> None:
    """Per-tensor vs bucketed vs one flat transfer, and the trainer's staging memory (the module docstring)."""
    from safetensors.torch import load_file

    sd = load_file(os.path.join(path, "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    sd = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in sd.items()}  # new weights to push
    if args.device == "cuda":
        sd = {k: v.cuda() for k, v in sd.items()}
    groups = group_by_module(sd)
    singles = per_tensor(groups)
    n_tensors, n_bytes = len(sd), sum(v.numel() * v.element_size() for v in sd.values())
    assert args.smoke or (n_tensors >= 300 and n_bytes >= 25e6), (n_tensors, n_bytes)
    print(
        f"model: {n_tensors} tensors, {n_bytes / 1e6:.1f} MB float32, {len(groups)} modules; "
        f"bucket_mb={args.bucket_mb}, median of {args.repeats}",
        flush=True,
    )

    # smoke: bfloat16, so that the delta part (run on this server) sees the sparse changes of a bf16 engine
    extra = ["--dtype", "bfloat16" if args.smoke else "float32", "--max-model-len", "256", "--enforce-eager"]
    if args.device == "cuda":
        extra += ["--gpu-memory-utilization", "0.3"]
    # smoke: the worker inside the engine-core process, the API process forked from the warm interpreter, up sooner
    # (the transports are what is measured)
    env = TWO_PROCESS_ENV if args.smoke else None
    server = launch_bench_server(path, extra, env=env, warm=args.smoke)
    results.update({"tensors": n_tensors, "bytes": n_bytes})
    if args.device == "cuda":  # NCCL broadcast from the trainer's GPU, and CUDA IPC handles instead of shared memory
        transports = (
            ("broadcast", lambda c, mb: BroadcastTransport(c, mb, device="cuda")),
            ("cuda_ipc", lambda c, mb: CudaIpcTransport(c, mb, device="cuda")),
        )
    else:
        transports = (("broadcast", BroadcastTransport), ("shm", ShmTransport))
    try:
        client = ServerClient(server.url, timeout=300)
        for name, cls in transports:
            one_each, bucketed, flat = cls(client, PER_TENSOR_MB), cls(client, args.bucket_mb), cls(client, 1e9)
            try:
                r = {
                    "per_tensor_s": median_time(lambda t=one_each: t.push(singles, 1), args.repeats),
                    "bucketed_s": median_time(lambda t=bucketed: t.push(groups, 2), args.repeats),
                    "flat_wire_s": median_time(lambda t=flat: t.push(groups, None, load=False), args.repeats),
                    "flat_loaded_s": median_time(lambda t=flat: t.push(groups, 3), args.repeats),
                    "buckets": len(list(iter_buckets(groups, args.bucket_mb))),
                }
                phases = bucketed.push(groups, 4)["phases"]  # where a bucketed sync spends its time (worker side)
            finally:
                for t in (one_each, bucketed, flat):
                    t.close()
            r["worker_phases_s"] = {k: round(v, 4) for k, v in phases.items()}
            r["speedup"] = r["per_tensor_s"] / r["bucketed_s"]
            r["bucketed_over_flat_wire"] = r["bucketed_s"] / r["flat_wire_s"]
            r["bucketed_over_flat_loaded"] = r["bucketed_s"] / r["flat_loaded_s"]
            r["flat_wire_GBps"] = n_bytes / r["flat_wire_s"] / 1e9
            results[name] = r
            print(
                f"{name:9s}  per-tensor {r['per_tensor_s']:.3f} s | bucketed ({r['buckets']} buckets) "
                f"{r['bucketed_s']:.3f} s | flat wire {r['flat_wire_s']:.3f} s ({r['flat_wire_GBps']:.2f} GB/s) "
                f"| flat loaded {r['flat_loaded_s']:.3f} s",
                flush=True,
            )
            print(
                f"{'':9s}  speedup {r['speedup']:.1f}x | bucketed/flat-wire {r['bucketed_over_flat_wire']:.2f}x "
                f"| bucketed/flat-loaded {r['bucketed_over_flat_loaded']:.2f}x | worker phases "
                f"{r['worker_phases_s']}",
                flush=True,
            )
        results["staging"] = staging_ratio(path, server.url, n_bytes, warm=args.smoke)
        if args.smoke:  # the delta part on this (bfloat16) server: one server start for the smoke
            results["delta"] = delta_bench(args, path, server.url)
    finally:
        server.stop()


#: the learning rates of the delta part (RL's usual range)
DELTA_LRS = (1e-6, 1e-5)


def delta_bench(args, tiny_path: str, url: str | None = None) -> dict:
    """Delta vs full pushes into a bfloat16 server (see the module docstring); `url`: a running bf16 server of
    `tiny_path` (the smoke's), else SmolLM2's is started here."""
    from grpo_async.testing import build_smollm2

    path, server = tiny_path, None
    if url is None:
        path = build_smollm2()
        extra = ["--dtype", "bfloat16", "--max-model-len", "256", "--enforce-eager"]
        server = launch_bench_server(path, extra)
        url = server.url
    out: dict = {"model": os.path.basename(path.rstrip("/")), "engine_dtype": "bfloat16", "steps": args.delta_steps}
    try:
        for transport in ("broadcast", "shm"):
            out[transport] = {str(lr): delta_run(path, url, transport, lr, args) for lr in DELTA_LRS}
    finally:
        if server is not None:
            server.stop()
    out["bitwise"] = all(r["bitwise"] for t in ("broadcast", "shm") for r in out[t].values())
    return out


def delta_run(path: str, url: str, transport: str, lr: float, args) -> dict:
    """One learning rate over one transport: `args.delta_steps` optimizer steps each published as a delta, then the
    final weights published whole (float32 as today; bfloat16 in the engine's dtype)."""
    from transformers import AutoModelForCausalLM

    from grpo_async.generation.shared import SharedBackend
    from grpo_async.generation.vllm_server import VLLMServerBackend
    from grpo_async.pipeline.publisher import PolicyPublisher

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)  # transformers.Trainer's default decay
    client = ServerClient(url, timeout=300)

    def publisher(**kw):
        backend = VLLMServerBackend([url], transport=transport, bucket_mb=64.0, timeout=300, **kw)
        return backend, PolicyPublisher(SharedBackend(lambda: backend))

    def publish(pub, version):
        seconds = pub.publish(model, version)
        return seconds, pub.backend.get().sink.delta

    backend, pub = publisher(delta=True, delta_full_every=10**6)
    deltas = []
    try:
        publish(pub, 0)  # the first push is whole: it seeds both copies
        for step in range(1, args.delta_steps + 1):
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seconds, sync = publish(pub, step)
            last = sync.last
            assert set(last["modes"].values()) == {"delta"}, last["modes"]
            (sent,) = last["bytes"].values()
            deltas.append(
                {
                    "seconds": seconds,
                    "bytes": sent,
                    "changed": last["changed"] / last["elements"],
                    "encode_s": last["encode_s"],
                }
            )
        engine_bytes = last["full_bytes"]
        after_deltas = greedy_logprobs(client, path)
    finally:
        pub.backend.close()
    whole = {}
    for name, kw in (("full_engine_dtype", {"delta": True, "delta_full_every": 1}), ("full", {})):
        backend, pub = publisher(**kw)
        times = []
        try:
            for r in range(args.repeats + 1):  # the first one also connects (broadcast: the process group)
                seconds = pub.publish(model, 1000 + r)
                if r:
                    times.append(seconds)
            sent = engine_bytes if kw else pub.last["bytes"]
        finally:
            pub.backend.close()
        whole[name] = {"seconds": statistics.median(times), "bytes": sent}
    bitwise = greedy_logprobs(client, path) == after_deltas  # the same weights pushed whole, last
    client.close()
    d_bytes = statistics.median(d["bytes"] for d in deltas)
    d_seconds = statistics.median(d["seconds"] for d in deltas)
    row = {
        "delta": {"bytes": d_bytes, "seconds": d_seconds, "steps": deltas},
        **whole,
        "bytes_ratio": whole["full_engine_dtype"]["bytes"] / max(d_bytes, 1),
        "bytes_ratio_vs_float32": whole["full"]["bytes"] / max(d_bytes, 1),
        "seconds_ratio": whole["full"]["seconds"] / d_seconds,
        "seconds_ratio_engine_dtype": whole["full_engine_dtype"]["seconds"] / d_seconds,
        "bitwise": bitwise,
    }
    changed = statistics.mean(d["changed"] for d in deltas)
    print(
        f"delta {transport:9s} lr {lr:g}: {changed:.2%} of the bf16 values change per step | bytes/sync: delta "
        f"{d_bytes / 1e6:.2f} MB, full bf16 {whole['full_engine_dtype']['bytes'] / 1e6:.1f} MB "
        f"({row['bytes_ratio']:.1f}x), full float32 {whole['full']['bytes'] / 1e6:.1f} MB "
        f"({row['bytes_ratio_vs_float32']:.1f}x) | s/sync: delta {d_seconds:.3f}, full bf16 "
        f"{whole['full_engine_dtype']['seconds']:.3f}, full float32 {whole['full']['seconds']:.3f} "
        f"({row['seconds_ratio']:.2f}x) | engine after deltas == after a full push: {bitwise}",
        flush=True,
    )
    return row


def greedy_logprobs(client, model: str) -> list:
    """The engine's greedy tokens and their log-probs for a few fixed prompts."""
    out = []
    for prompt in ([7, 8, 9, 10, 11], [20, 21, 22, 23]):
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 0}
        choice = client.post("/v1/completions", {**body, "return_token_ids": True})["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def staging_ratio(path: str, url: str, model_bytes: int, *, warm: bool = False) -> dict:
    """Peak extra memory of a trainer process during a publish through the trainer's own path (`PolicyPublisher`
    streaming the live model's groups into `VLLMServerBackend`, broadcast, buckets of ~1/10 of the model), ÷ the
    model's bytes; beside it, what staging a full CPU copy first (`collect_state_dict`, the old path) costs.

    Measured in a child process (a fresh one; a fork of the warm interpreter with `warm`, the smoke's) that first sets
    glibc's mmap threshold to 64 KiB (`_malloc_follows_live_memory`): every block of 64 KiB or more is then mapped on
    its own and unmapped when freed, so the resident set follows live memory (with the default dynamic threshold,
    buffers freed by a first publish stay in the heap and hide the second one's). RSS is sampled every ~0.5 ms; the
    baseline is taken right before each measured step. The ratio is the second publish's (a publish of a running
    training); the first one, which also connects the process group, is reported beside it. In a warm fork the
    preloaded heap's free space absorbs some of the small blocks: on the smoke's 1.8 MB model the second publish read
    the same there as in a fresh child (0.21 MB), the first 6.3 MB against 13.3 (no first-use imports left to do) and
    the staged copy 1.0 MB against 1.7: the smoke checks that the measurement runs, the full run measures."""
    args = ["--staging-child", path, url, str(model_bytes)]
    proc = run_python(os.path.abspath(__file__), args, timeout=600, warm=warm)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("STAGING ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"staging measurement failed (exit {proc.returncode}):\n{proc.stdout[-6000:]}")
    out = json.loads(lines[-1][len("STAGING ") :])
    print(
        f"staging  publish from the live model ({out['buckets']} buckets of {out['bucket_mb']} MiB): peak extra "
        f"{out['peak_extra_mb']} MB of {out['model_mb']} MB model = {out['ratio']:.3f} (the first publish, which also "
        f"connects the process group: {out['first_extra_mb']} MB = {out['first_publish_ratio']:.3f}) | a staged full "
        "CPU copy first: "
        f"{out['staged_copy_extra_mb']} MB = {out['staged_copy_ratio']:.3f}",
        flush=True,
    )
    return out


def _malloc_follows_live_memory() -> None:
    """glibc's `MALLOC_MMAP_THRESHOLD_=65536`, set from inside the process (`mallopt`; the variable is read only when
    a process starts, which a fork does not): blocks of 64 KiB or more are mapped on their own and unmapped when
    freed, the threshold no longer adapts. Then `malloc_trim(0)` returns what the heap holds free to the system
    (pages in the middle of the heap included), so a block later carved from a chunk freed before this point faults
    its pages in again and shows in the resident set, as it would in a process that had the setting from its start."""
    import ctypes

    libc = ctypes.CDLL(None)
    m_mmap_threshold = -3  # <malloc.h>
    if libc.mallopt(m_mmap_threshold, 65536) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD, 65536) failed: the staging measurement needs glibc's malloc")
    libc.malloc_trim(0)


def _staging_child(path: str, url: str, model_bytes: int) -> None:
    import gc
    import threading

    from transformers import AutoModelForCausalLM

    from grpo_async.generation.shared import SharedBackend
    from grpo_async.generation.vllm_server import VLLMServerBackend
    from grpo_async.pipeline.publisher import PolicyPublisher
    from grpo_async.weight_sync.collect import collect_state_dict

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    bucket_mb = model_bytes / 10 / (1 << 20)
    shared = SharedBackend(lambda: VLLMServerBackend([url], transport="broadcast", bucket_mb=bucket_mb, timeout=300))
    shared.get()  # connect HTTP before the baseline (the process group is set up by the first publish)
    publisher = PolicyPublisher(shared)

    def peak_extra(fn) -> int:
        gc.collect()
        peak, stop = [0], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _rss())
                time.sleep(0.0005)

        base = _rss()
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        result = fn()
        stop.set()
        thread.join()
        del result
        return max(0, peak[0] - base)

    first = peak_extra(lambda: publisher.publish(model, 1))
    second = peak_extra(lambda: publisher.publish(model, 2))
    staged = peak_extra(lambda: collect_state_dict(model, device="cpu"))
    shared.close()
    extra = second
    out = {
        "bucket_mb": round(bucket_mb, 2),
        "buckets": len(list(iter_buckets(group_by_module(dict(model.state_dict())), bucket_mb))),
        "first_extra_mb": round(first / 1e6, 2),
        "second_extra_mb": round(second / 1e6, 2),
        "peak_extra_mb": round(extra / 1e6, 2),
        "model_mb": round(model_bytes / 1e6, 2),
        "ratio": extra / model_bytes,
        "first_publish_ratio": first / model_bytes,
        "staged_copy_extra_mb": round(staged / 1e6, 2),
        "staged_copy_ratio": staged / model_bytes,
    }
    print("STAGING " + json.dumps(out), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--staging-child":
        _malloc_follows_live_memory()
        _staging_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
