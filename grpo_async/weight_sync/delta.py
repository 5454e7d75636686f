"""Delta weight sync (`GRPOConfig.weight_sync_delta`): a push sends only the values that changed *in the engine's
dtype* since the last push the server acknowledged.

With a bfloat16 engine and RL learning rates most bf16 values do not move from one optimizer step to the next (an
Adam step of 1e-6 is far below half a bf16 ulp of a typical weight), so a push of the changed values is a few percent
of a full one. Both ends keep the last acknowledged weights in the engine's dtype:

```txt
trainer (DeltaSync)                                            server worker (DeltaShadow)
baseline {name: tensor in engine dtype}, id "a1b2-7"           shadow {name: tensor in engine dtype}, id "a1b2-7"
push 8: cast each tensor, compare bit patterns with baseline
        send per tensor: nothing | idx+val | mask+val | full ─▶ begin: refuse unless its id is the push's base
        update baseline in place                                apply each part to the shadow in place
close:  {"delta": {"id": "a1b2-8", "checksum": C}}      ─────▶ checksum(shadow) == C ? load it all : refuse (409)
        C = checksum(baseline)                          ◀───── {"delta": {"id": "a1b2-8", "checksum": C}}
```

**Wire format** (per bucket, carried by any transport unchanged: the parts are ordinary named tensors of the bucket
layout, `grpo_async.weight_sync.buckets`). For a tensor `name` of `n` elements, `k` of which changed, element size
`e` bytes in the engine's dtype, the sender picks the smallest of:

| encoding | tensors sent | bytes |
|---|---|---|
| unchanged | none | 0 |
| sparse | `name:idx` (int32 flat indices; int64 from 2**31 elements), `name:val` (engine dtype) | `k·(4 + e)` |
| mask | `name:mask` (uint8, bit `i % 8` of byte `i // 8` = element `i` changed), `name:val` | `n/8 + k·e` |
| full | `name` (engine dtype) | `n·e` |

Sparse wins below `k/n = 1/32` (bf16: 6 bytes per changed value), the mask up to `1 − 1/(8e)` (94 % in bf16).
"Changed" compares bit patterns (`-0.0` and `+0.0` differ, a NaN equals itself), so the receiver's copy is bitwise
the trainer's. A full push in delta mode also travels in the engine's dtype (half the bytes of a float32 trainer's
full push into a bf16 engine; the values are what the engine's loader would have rounded them to).

**When a push is full**: the first push to a server; after any push that failed, was aborted (the trainer's baseline
was left half-updated: its id is cleared when a push starts and set when one completes) or whose checksum disagreed;
for a server that rejoins the rotation; every `full_every`-th push to a server; and whenever a server refuses a delta
(`DeltaRefused`, HTTP 409): a restarted server, or one whose weights someone else replaced, holds no shadow or
another one, and refuses the push at `begin` without loading anything. The trainer then sends it a full push of its
baseline, within the same publish, so it never serves a round on other weights. A server's copy is checked at every
push: the closing request carries the checksum of the trainer's baseline, and the server loads nothing unless its own
copy sums to the same (the checksum is a 64-bit sum of each tensor's bytes read as int64 words, weighted per tensor
name: it catches a lost or misplaced update, it is not a cryptographic hash).

**Memory**: the trainer keeps one copy of the weights in the engine's dtype (bf16: 2 bytes per parameter, 270 MB
for a 135M model), on the parameters' device; each server worker keeps one too, in CPU memory beside its model
(the staged push loads from it: a delta push stages no other copy).

Supported: `grpo-async serve` servers (`VLLMServerBackend`) over every wire transport (`shm`, `broadcast`, and
`cuda_ipc`, which carries the same buckets; not run here without a GPU build of vLLM). Refused: the in-process
`vllm` and `hf` backends (the weights are handed over by reference, no bytes move), `openai` (checkpoint folder) and
stock `vllm serve` servers (vLLM's weight-transfer API carries no shadow).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import time

import numpy as np
import torch

from grpo_async.weight_sync.buckets import NamedTensors, group_by_module, single_thread

logger = logging.getLogger("grpo_async.weight_sync")

#: suffixes of the parts of a delta-coded tensor (`name:idx`, `name:mask`, `name:val`)
PARTS = ("idx", "mask", "val")
#: the integer dtype whose bit patterns are compared, by element size
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MASK64 = (1 << 64) - 1


class DeltaRefused(ValueError):  # noqa: N818 - the name travels in the server's error message (see `is_refusal`)
    """A server refuses a delta push: it holds no copy of the push's base (restarted, or its weights were replaced by
    another push) or its copy's checksum differs from the trainer's. Nothing is loaded; the trainer sends a full
    push instead."""


def is_refusal(error: BaseException) -> bool:
    """Whether a push failed because the server refused the delta (`DeltaRefused`, answered as HTTP 409)."""
    return getattr(error, "status", None) == 409 and DeltaRefused.__name__ in str(error)


# ---------------------------------------------------------------------------------------------- the codec (pure)
def _flat_int(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of the same size (bit patterns), flat."""
    return t.reshape(-1).view(INT_VIEW[t.element_size()])


def nonzero(flags: torch.Tensor) -> torch.Tensor:
    """Flat int64 indices of the true elements of a flat bool tensor, ascending (numpy's on CPU: ~3x torch's)."""
    if flags.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(flags.numpy()))
    return flags.nonzero().view(-1)


def pack_mask(changed: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor → uint8 bits, element `i` in bit `i % 8` of byte `i // 8`."""
    if changed.device.type == "cpu":
        return torch.from_numpy(np.packbits(changed.numpy(), bitorder="little"))
    n = changed.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=changed.device)
    padded[:n] = changed
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=changed.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_mask(bits: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_mask`: the first `n` elements."""
    if bits.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(bits.numpy(), count=n, bitorder="little").view(np.bool_))
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.view(-1, 1) >> shifts) & 1).view(-1)[:n].bool()


def encode_tensor(name: str, new: torch.Tensor, base: torch.Tensor) -> tuple[NamedTensors, int]:
    """The smallest encoding of `new` against `base` (same dtype and shape; see the module's table), and the number
    of elements that changed; `base` is updated to `new` in place."""
    n, e = new.numel(), new.element_size()
    flat_new, flat_base = new.reshape(-1), base.view(-1)
    changed = _flat_int(new) != _flat_int(base)
    k = int(torch.count_nonzero(changed))
    if k == 0:
        return [], 0
    idx_size = 4 if n < 2**31 else 8
    sparse, mask, full = k * (idx_size + e), -(-n // 8) + k * e, n * e
    if full <= min(sparse, mask):
        flat_base.copy_(flat_new)
        return [(name, new)], k
    idx = nonzero(changed)  # gathers and scatters by index: ~4x a masked_select / masked_scatter_ here
    vals = flat_new[idx]
    flat_base[idx] = vals
    if sparse <= mask:
        return [(f"{name}:idx", idx.to(torch.int32 if idx_size == 4 else torch.int64)), (f"{name}:val", vals)], k
    return [(f"{name}:mask", pack_mask(changed)), (f"{name}:val", vals)], k


def split_part(wire_name: str) -> tuple[str, str | None]:
    """`"a.weight:idx"` → `("a.weight", "idx")`; a plain name → `(name, None)` (HF names hold no `:`)."""
    base, sep, part = wire_name.rpartition(":")
    return (base, part) if sep and part in PARTS else (wire_name, None)


def apply_parts(parts: dict[str, torch.Tensor], target: torch.Tensor, name: str) -> None:
    """Apply one tensor's `{"idx"|"mask": ..., "val": ...}` to `target` in place; `ValueError` when malformed."""
    flat, vals = target.view(-1), parts.get("val")
    if vals is None or ("idx" in parts) == ("mask" in parts):
        raise ValueError(f"delta of {name!r}: needs 'val' and exactly one of 'idx' / 'mask', got {sorted(parts)}")
    if vals.dtype != target.dtype or vals.dim() != 1:
        raise ValueError(f"delta of {name!r}: values must be 1-D {target.dtype}, got {vals.dtype} {list(vals.shape)}")
    if "idx" in parts:
        idx = parts["idx"]
        if idx.dtype not in (torch.int32, torch.int64) or idx.shape != vals.shape:
            raise ValueError(f"delta of {name!r}: indices must be int32/int64, one per value")
        idx = idx.long()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= flat.numel()):
            raise ValueError(f"delta of {name!r}: an index is outside its {flat.numel()} elements")
        flat[idx] = vals
        return
    bits = parts["mask"]
    if bits.dtype != torch.uint8 or bits.numel() != -(-flat.numel() // 8):
        raise ValueError(f"delta of {name!r}: the mask must be {-(-flat.numel() // 8)} uint8 bytes")
    idx = nonzero(unpack_mask(bits, flat.numel()))
    if idx.numel() != vals.numel():
        raise ValueError(f"delta of {name!r}: the mask marks {idx.numel()} values, {vals.numel()} were sent")
    flat[idx] = vals


def _word_sum(t: torch.Tensor) -> int:
    """The tensor's bytes read as little-endian int64 words (the tail zero-padded), summed modulo 2**64."""
    b = t.detach().reshape(-1).view(torch.uint8)
    whole = b.numel() // 8 * 8
    total = 0
    if whole:
        words = b[:whole]
        try:
            words = words.view(torch.int64)
        except RuntimeError:  # storage not 8-byte aligned
            words = words.clone().view(torch.int64)
        total = int(words.sum())
    if whole < b.numel():
        total += int.from_bytes(bytes(b[whole:].cpu().tolist()), "little")
    return total & MASK64


def _name_weight(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") | 1


def tensor_sum(name: str, t: torch.Tensor) -> int:
    """One tensor's term of `checksum` (cached per tensor by the trainer)."""
    return (_word_sum(t) * _name_weight(name) + t.numel()) & MASK64


def combine(sums) -> str:
    """The checksum of a set of tensors from their `tensor_sum`s (order does not matter)."""
    return f"{sum(sums) & MASK64:016x}"


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """16 hex digits over every tensor's bytes and name (see the module docstring)."""
    return combine(tensor_sum(n, t) for n, t in tensors.items())


def validate_delta_spec(spec: object, req: dict) -> dict:
    """Check the `delta` part of a `/ws/update` request: `{"mode": "full" | "delta", "id": str, "base": str (delta
    only), "checksum": str (optional: the closing request's)}`."""
    keys = {"mode", "id", "base", "checksum"}
    if not isinstance(spec, dict) or set(spec) - keys or "mode" not in spec or "id" not in spec:
        raise ValueError(f"'delta' must be an object with keys mode, id (base, checksum optional), got {spec!r:.200}")
    if spec["mode"] not in ("full", "delta"):
        raise ValueError(f"'delta.mode' must be 'full' or 'delta', got {spec['mode']!r}")
    for key in ("id", "base", "checksum"):
        if key in spec and not (isinstance(spec[key], str) and 0 < len(spec[key]) <= 64):
            raise ValueError(f"'delta.{key}' must be a string of 1-64 characters, got {spec[key]!r:.80}")
    if (spec["mode"] == "delta") != ("base" in spec):
        raise ValueError("'delta.base' (the id of the weights the delta applies to) goes with mode 'delta' only")
    if not req.get("load", True) or req.get("lora") is not None or req.get("expect") is not None:
        raise ValueError("'delta' is for a push that loads full weights (no load=false, lora or expect)")
    return spec


# ---------------------------------------------------------------------------------------------- worker side
class DeltaShadow:
    """A server worker's copy of the last weights it loaded from a delta-mode push (engine dtype, CPU), with the id
    the trainer gave them. One push at a time: `begin` → `take` per bucket → `complete` → `verify` → `commit`; or
    `abort` / `drop`."""

    def __init__(self):
        self.id: str | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.checksum: str | None = None
        self.spec: dict | None = None  # the open push's
        self.expected: str | None = None  # the checksum the trainer expects (its closing request's)

    @property
    def open(self) -> bool:
        return self.spec is not None

    def info(self) -> dict:
        return {"id": self.id, "checksum": self.checksum, "tensors": len(self.tensors)}

    def begin(self, spec: dict) -> None:
        """Open a push; a delta whose base is not this copy is refused (`DeltaRefused`), a full one drops the copy."""
        if spec["mode"] == "delta":
            if self.id is None or spec["base"] != self.id:
                held = "no copy (a restarted server, or weights replaced by a push without delta)"
                raise DeltaRefused(
                    f"a delta on weights {spec['base']!r}, but this server holds "
                    f"{held if self.id is None else repr(self.id)}: send a full push"
                )
        else:
            self.tensors = {}  # replaced by this push; an aborted full push leaves none
        self.id, self.checksum, self.spec = None, None, spec  # dirty until committed

    def take(self, named: NamedTensors, dtype: torch.dtype, copy: bool) -> NamedTensors:
        """Apply one bucket to the copy; returns the full tensors it touched (views of the copy), to stage.
        `copy`: a full tensor received is a view of memory the sender reuses (shared memory): copy it."""
        parts: dict[str, dict[str, torch.Tensor]] = {}
        out = []
        for wire, t in named:
            name, part = split_part(wire)
            if part is not None:
                parts.setdefault(name, {})[part] = t
                continue
            held = self.tensors.get(name)
            if held is not None and held.shape == t.shape:
                held.copy_(t)  # in place: no allocation, and the received buffer can go
            else:
                own = t.detach().to("cpu", dtype)
                self.tensors[name] = (own.clone() if copy and own.data_ptr() == t.data_ptr() else own).contiguous()
            out.append((name, self.tensors[name]))
        for name, p in parts.items():
            if name not in self.tensors:
                raise ValueError(f"a delta of {name!r}, which this server's copy does not hold")
            apply_parts(p, self.tensors[name], name)
            out.append((name, self.tensors[name]))
        return out

    def complete(self, received: set[str]) -> NamedTensors:
        """The tensors the push did not touch (unchanged since the base): staged from the copy."""
        return [(n, t) for n, t in self.tensors.items() if n not in received]

    def verify(self, expected: str | None) -> str:
        """The copy's checksum; `DeltaRefused` when the trainer's (`expected`) differs."""
        got = checksum(self.tensors)
        if expected is not None and got != expected:
            raise DeltaRefused(
                f"checksum of the server's copy after this push is {got}, the trainer's is {expected}: "
                "nothing was loaded; send a full push"
            )
        return got

    def commit(self, total: str) -> dict:
        self.id, self.checksum, self.spec = self.spec["id"], total, None
        return self.info()

    def abort(self) -> None:
        """The open push is dropped: the copy was (maybe) half-updated in place, so it goes."""
        if self.spec is not None:
            self.drop()

    def drop(self) -> None:
        """Forget everything (the model's weights changed some other way, or a load failed)."""
        self.id, self.checksum, self.spec, self.tensors = None, None, None, {}


# ---------------------------------------------------------------------------------------------- trainer side
class DeltaSync:
    """The trainer's side of delta sync for a set of servers (one `ServerFanout`): the baseline in the engine's
    dtype, what each server acknowledged, and the statistics of the last push (`last`).

    Args:
        full_every (`int`, *optional*, defaults to 50): every `full_every`-th push to a server is a full one (1:
            every push).
        dtype (`torch.dtype`, *optional*): the engines' dtype; asked from each server's `/ws/info` when omitted.
    """

    def __init__(self, full_every: int = 50, dtype: torch.dtype | None = None):
        if not (isinstance(full_every, int) and full_every >= 1):
            raise ValueError(f"full_every must be an integer >= 1, got {full_every!r}")
        self.full_every = full_every
        self.dtype = dtype
        self.baseline: dict[str, torch.Tensor] = {}
        self.sums: dict[str, int] = {}
        self.base_id: str | None = None  # the baseline's id while it is what the acknowledging servers hold
        self.acked: dict[str, str] = {}  # server url -> id of the weights it acknowledged
        self.since_full: dict[str, int] = {}  # server url -> delta pushes since its last full one
        self.dtypes: dict[str, torch.dtype] = {}  # server url -> its engine's dtype
        self.last: dict | None = None
        self._token = secrets.token_hex(4)
        self._count = 0

    def forget(self, url: str) -> None:
        """A server that left or came back: its next push is full."""
        self.acked.pop(url, None)
        self.since_full.pop(url, None)
        self.dtypes.pop(url, None)

    def engine_dtype(self, client) -> torch.dtype:
        """The dtype of `client`'s engine (`/ws/info`, asked once per server)."""
        if self.dtype is not None:
            return self.dtype
        if client.url not in self.dtypes:
            workers = (client.get("/ws/info") or {}).get("workers") or [{}]
            name = workers[0].get("dtype")
            if not isinstance(name, str) or not isinstance(getattr(torch, name, None), torch.dtype):
                raise RuntimeError(f"weight_sync_delta: {client.url} does not say its engine's dtype in /ws/info")
            self.dtypes[client.url] = getattr(torch, name)
        return self.dtypes[client.url]

    def plan(self, urls: list[str]) -> DeltaPush:
        """Start a push to the servers `urls` (their dtypes known: `engine_dtype`): each gets a delta or a full push
        (see the module docstring)."""
        dtypes = {self.dtype or self.dtypes[u] for u in urls}
        if len(dtypes) > 1:
            raise RuntimeError(
                f"weight_sync_delta: the servers run different dtypes {sorted(map(str, dtypes))}; a delta is computed "
                "in one engine dtype (start them with the same --dtype, or set weight_sync_delta=False)"
            )
        dtype = dtypes.pop() if dtypes else self.dtype
        self._count += 1
        push = DeltaPush(self, urls, f"{self._token}-{self._count}", dtype)
        self.base_id = None  # half-updated until the push completes
        return push


class DeltaPush:
    """One push of a `DeltaSync` (made by `DeltaSync.plan`)."""

    def __init__(self, sync: DeltaSync, urls: list[str], new_id: str, dtype: torch.dtype | None):
        self.sync, self.id, self.dtype, self.base = sync, new_id, dtype, sync.base_id
        self.modes = {u: "delta" if self._can_delta(u) else "full" for u in urls}
        self.sent = dict.fromkeys(urls, 0)  # bytes sent to each server
        self.stats = {"full_bytes": 0, "changed": 0, "elements": 0, "tensors": 0, "encode_s": 0.0, "retried": []}
        self.answers: dict[str, dict] = {}
        self.phases: dict[str, dict | None] = {}  # the server's seconds per phase (begin, receive, load, end)
        self.coding = "delta" in self.modes.values()  # whether buckets are delta-coded (decided once per push)

    def _can_delta(self, url: str) -> bool:
        s = self.sync
        return self.base is not None and s.acked.get(url) == self.base and s.since_full.get(url, 0) + 1 < s.full_every

    def spec(self, url: str) -> dict:
        """The `delta` part of the requests of this push to `url`."""
        if self.modes[url] == "delta":
            return {"mode": "delta", "base": self.base, "id": self.id}
        return {"mode": "full", "id": self.id}

    def encode(self, bucket: NamedTensors) -> dict[str, NamedTensors]:
        """`{"full": the bucket in the engine's dtype, "delta": its changed values}`; updates the baseline (and the
        cached checksum terms of the tensors that changed)."""
        t0 = time.perf_counter()
        on_cpu = bool(bucket) and bucket[0][1].device.type == "cpu"
        with (
            single_thread() if on_cpu else contextlib.nullcontext()
        ):  # 2 threads on a busy 2-core machine: ~10x slower
            out = self._encode(bucket)
        self.stats["encode_s"] += time.perf_counter() - t0
        return out

    def _encode(self, bucket: NamedTensors) -> dict[str, NamedTensors]:
        sync, full, delta = self.sync, [], []
        for name, t in bucket:
            new = (t.detach().to(self.dtype) if self.dtype is not None else t.detach()).contiguous()
            full.append((name, new))
            self.stats["elements"] += new.numel()
            self.stats["full_bytes"] += new.numel() * new.element_size()
            self.stats["tensors"] += 1
            base = sync.baseline.get(name)
            fresh = base is None or (base.shape, base.dtype, base.device) != (new.shape, new.dtype, new.device)
            if fresh:
                base = sync.baseline[name] = torch.empty_like(new)
            if fresh or not self.coding:
                base.copy_(new)
                k = new.numel()
                if self.coding:  # a tensor the servers never had: sent whole
                    delta.append((name, new))
            else:
                parts, k = encode_tensor(name, new, base)
                delta.extend(parts)
            if self.coding:
                self.stats["changed"] += k
            if k or name not in sync.sums:
                sync.sums[name] = tensor_sum(name, base)
        return {"full": full, "delta": delta}

    def payload(self, url: str, coded: dict[str, NamedTensors]) -> NamedTensors | None:
        """What `url` gets of a coded bucket (`None`: nothing, an unchanged bucket of a delta push)."""
        bucket = coded[self.modes[url]]
        if not bucket:
            return None
        self.sent[url] += sum(t.numel() * t.element_size() for _, t in bucket)
        return bucket

    @property
    def expected(self) -> str:
        return combine(self.sync.sums.values())

    def close_extra(self, url: str) -> dict:
        """The closing request's `delta` (with the checksum the server's copy must have)."""
        return {"delta": {**self.spec(url), "checksum": self.expected}}

    def refused(self, url: str) -> None:
        """`url` refused this push's delta (or its checksum): it gets a full push of the baseline next."""
        self.modes[url] = "full"
        self.sent[url] = 0
        self.stats["retried"].append(url)

    def baseline_groups(self):
        """The baseline as module groups (a full push of the trainer's copy, for a server that refused a delta)."""
        return group_by_module(self.sync.baseline)

    def acknowledged(self, url: str, answer: dict | None) -> None:
        got = (answer or {}).get("delta") or {}
        if got.get("id") != self.id or got.get("checksum") != self.expected:
            logger.warning("weight_sync_delta: %s acknowledged %s, not %s: its next push is whole", url, got, self.id)
            self.sync.forget(url)
            return
        self.answers[url] = got
        self.phases[url] = (answer or {}).get("phases")
        s = self.sync
        s.acked[url] = self.id
        s.since_full[url] = 0 if self.modes[url] == "full" else s.since_full.get(url, 0) + 1

    def finish(self) -> dict:
        """After every server closed: the baseline is what the acknowledging servers hold (or nothing)."""
        s = self.sync
        for url in list(s.acked):
            if url not in self.answers:
                s.forget(url)
        s.base_id = self.id if self.answers else None
        s.last = {
            **self.stats,
            "changed": self.stats["changed"] if self.coding else None,
            "modes": dict(self.modes),
            "bytes": dict(self.sent),
            "acked": sorted(self.answers),
            "server_phases": dict(self.phases),
            "id": self.id,
            "checksum": self.expected,
        }
        return s.last
