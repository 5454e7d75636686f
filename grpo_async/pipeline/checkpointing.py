"""Checkpoints that resume the pipeline exactly: its position (micro-steps, rounds, rounds in flight), written
atomically next to the Trainer's own files.

```txt
output_dir/_grpo_async_saving/checkpoint-60/   every process writes here (Trainer files + grpo_async_state.json)
        │ rename (main process), only when complete
        ▼
output_dir/checkpoint-60/                      then old checkpoints are rotated
```
A process killed mid-save leaves the previous checkpoints untouched, and `get_last_checkpoint` never sees a partial
one (it only lists `checkpoint-<n>` folders).

Example of the state file:
    {"micro_steps": 120, "round": 60, "policy_version": 60, "submitted_rounds": [60],
     "in_flight": [{"round_id": 60, "policy_version": 59, "generation_time": 1.2, "samples": {...}}],
     "geometry": {"num_processes": 2, "per_device_train_batch_size": 4, ...}}

The rounds in flight (generated ahead, not yet trained: with `num_batches_ahead = k`, round r + k is generated from
the weights of k rounds before the checkpoint's) are saved whole: their tensors and metrics in `ROUNDS_FILE`
(safetensors, exact), their completions-table samples in the state file (JSON). A resumed run trains them as saved
instead of generating them again from the checkpoint's newer weights, so it ends where an uninterrupted run ends.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil

logger = logging.getLogger(__name__)

#: written into every checkpoint folder: the pipeline's position (micro-steps, rounds, rounds in flight, geometry)
PIPELINE_STATE_FILE = "grpo_async_state.json"
#: checkpoints are written under `output_dir/SAVING_DIR/checkpoint-N`, then renamed into place (atomic save)
SAVING_DIR = "_grpo_async_saving"  # "_*" is left out of the Trainer's hub uploads of output_dir
#: the tensors and metrics of the rounds in flight at the checkpoint (`in_flight` of the state file)
ROUNDS_FILE = "grpo_async_rounds.safetensors"


def strict_json(value):
    """A copy of `value` that strict JSON can hold: non-finite floats (`inf`, `nan`, which Python's `json` writes as
    the non-JSON `Infinity` / `NaN`) become `null`; `None` reads back as "no value" (e.g. no entropy measured yet).

    >>> strict_json({"last_world_entropy": float("inf"), "rounds": [1, float("nan")], "coef": 0.5})
    {'last_world_entropy': None, 'rounds': [1, None], 'coef': 0.5}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_pipeline_state(folder: str, state: dict) -> None:
    """Write `state` as strict JSON (RFC 8259: no `Infinity` / `NaN`, see `strict_json`), atomically; its
    `in_flight` rounds (`Round`s) go to `ROUNDS_FILE` first (`save_rounds`), described in the JSON."""
    state = dict(state)
    if "in_flight" in state:
        state["in_flight"] = save_rounds(folder, state["in_flight"])
    tmp = os.path.join(folder, PIPELINE_STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(strict_json(state), f, indent=1, allow_nan=False, default=str)
    os.replace(tmp, os.path.join(folder, PIPELINE_STATE_FILE))


def save_rounds(folder: str, rounds: list) -> list[dict]:
    """Save `Round`s: every tensor of their `MicroBatch` and their metrics (float64, NaN kept) in `ROUNDS_FILE` as
    `<round>/batch/<field>` and `<round>/metrics/<name>`; returns what the state file keeps of each (id, policy
    version, generation time, samples). Written atomically."""
    import torch
    from safetensors.torch import save_file

    tensors, described = {}, []
    for rnd in rounds:
        for name, t in rnd.batch.tensors().items():
            tensors[f"{rnd.round_id}/batch/{name}"] = t.detach().cpu().contiguous()
        for name, t in (rnd.batch.vision.flat() if rnd.batch.vision is not None else {}).items():
            tensors[f"{rnd.round_id}/vision/{name}"] = t.detach().cpu().contiguous()
        tensors[f"{rnd.round_id}/batch_num_items"] = torch.tensor(rnd.batch.num_items_in_batch, dtype=torch.float64)
        for name, v in rnd.metrics.items():
            tensors[f"{rnd.round_id}/metrics/{name}"] = torch.tensor(float(v), dtype=torch.float64)
        described.append(
            {
                "round_id": rnd.round_id,
                "policy_version": rnd.policy_version,
                "generation_time": rnd.generation_time,
                "metrics": list(rnd.metrics),  # their order
                "samples": rnd.samples,
            }
        )
    tmp = os.path.join(folder, ROUNDS_FILE + ".tmp")
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(folder, ROUNDS_FILE))
    return described


def load_rounds(folder: str, described: list[dict]) -> list:
    """The `Round`s `save_rounds` saved in `folder`, in the order of `described` (the state file's `in_flight`)."""
    from safetensors.torch import load_file

    from ..algo.vision import VisionRows
    from .types import MicroBatch, Round

    path = os.path.join(folder, ROUNDS_FILE)
    if not os.path.exists(path):
        raise ValueError(f"{folder}: the state file lists rounds in flight but {ROUNDS_FILE} is missing")
    tensors = load_file(path)
    rounds = []
    for d in described:
        rid = d["round_id"]
        prefix = f"{rid}/batch/"
        fields = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        vision = {k[len(f"{rid}/vision/") :]: v for k, v in tensors.items() if k.startswith(f"{rid}/vision/")}
        batch = MicroBatch(
            **fields, vision=VisionRows.from_flat(vision), num_items_in_batch=float(tensors[f"{rid}/batch_num_items"])
        )
        metrics = {name: float(tensors[f"{rid}/metrics/{name}"]) for name in d["metrics"]}
        rounds.append(Round(rid, d["policy_version"], batch, metrics, d["samples"], d["generation_time"]))
    return rounds


def batch_geometry(args, num_processes: int) -> dict:
    """What must not change across a resume (or prompts would be skipped or trained twice)."""
    return {
        "num_processes": num_processes,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "steps_per_generation": args.steps_per_generation,
        "num_iterations": args.num_iterations,
        "num_generations": args.num_generations,
        "seed": args.seed,
    }


def resolve_checkpoint(resume_from_checkpoint: str | bool, output_dir: str) -> str:
    """`True` → the newest `checkpoint-N` of `output_dir`; a path is returned as it is."""
    if resume_from_checkpoint is True:
        from transformers.trainer_utils import get_last_checkpoint

        path = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if path is None:
            raise ValueError(f"resume_from_checkpoint=True but {output_dir} has no checkpoint")
        return path
    return resume_from_checkpoint


def read_pipeline_state(checkpoint: str, geometry: dict) -> dict:
    """The saved state; raises when the checkpoint has none or the batch geometry changed since. Logs where the run
    resumes (optimizer step, round, rounds generated again)."""
    path = os.path.join(checkpoint, PIPELINE_STATE_FILE)
    if not os.path.exists(path):
        raise ValueError(
            f"{checkpoint} has no {PIPELINE_STATE_FILE}: it was not written by grpo_async's GRPOTrainer, so the "
            "pipeline position (rounds, micro-steps) cannot be restored"
        )
    with open(path) as f:
        saved = json.load(f)  # files written before strict JSON may hold `Infinity`: Python's json reads it
    diff = {k: (v, geometry.get(k)) for k, v in saved["geometry"].items() if geometry.get(k) != v}
    if diff:
        changed = ", ".join(f"{k}: {a} → {b}" for k, (a, b) in diff.items())
        raise ValueError(
            f"cannot resume from {checkpoint}: the batch geometry changed ({changed}); "
            "prompts would be skipped or trained twice. Resume with the settings the checkpoint was written with."
        )
    if saved.get("in_flight"):
        saved["in_flight"] = load_rounds(checkpoint, saved["in_flight"])
    restored = [r.round_id for r in saved.get("in_flight") or []]
    again = [r for r in saved.get("submitted_rounds") or [] if r not in restored]
    logger.warning(
        "resuming from %s: optimizer step %d, round %d%s%s",
        checkpoint,
        saved["policy_version"],
        saved["round"],
        f" (rounds {restored} generated ahead are restored as saved)" if restored else "",
        f" (rounds {again} generated ahead are generated again, from the checkpoint's weights)" if again else "",
    )
    return saved


def clear_staged(run_dir: str, name: str) -> str:
    """Remove what a killed save left in the staging folder; return the staging path of checkpoint `name`."""
    staged = os.path.join(run_dir, SAVING_DIR, name)
    if os.path.exists(staged):
        shutil.rmtree(staged)
    return staged


def move_into_place(run_dir: str, name: str, save_total_limit: int | None, best_model_checkpoint: str | None) -> None:
    """Rename the finished staging folder to `run_dir/name` (swapping out an older save of the same step), then
    rotate old checkpoints: they are deleted only now that the new one is complete (main process only)."""
    from transformers.trainer_utils import rotate_checkpoints

    staging_root = os.path.join(run_dir, SAVING_DIR)
    staged, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
    if os.path.exists(final):  # the same step saved again (after a resume): swap, then drop the old one
        old = os.path.join(staging_root, name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staged, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, final)
    rotate_checkpoints(
        output_dir=run_dir,
        save_total_limit=save_total_limit,
        best_model_checkpoint=best_model_checkpoint,
        use_mtime=True,
    )
    try:
        os.rmdir(staging_root)  # only when empty
    except OSError:
        pass


def _write_errno(folder: str) -> int | None:
    """Why writing into `folder` fails now: EFBIG when a file there reached the file-size limit (`ulimit -f`), else
    the errno of a 1 MiB probe write (ENOSPC when the disk is full); None when the probe succeeds."""
    import errno
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        for root, _, files in os.walk(folder):
            if any(os.path.getsize(os.path.join(root, f)) >= limit for f in files):
                return errno.EFBIG
    probe = os.path.join(folder if os.path.isdir(folder) else os.path.dirname(folder), ".grpo_async_write_probe")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 2**20)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e.errno
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    return None


def save_error(folder: str, error: BaseException, remove: bool) -> BaseException:
    """The error to raise when writing checkpoint `folder` failed: an `OSError` naming the folder and the errno
    (torch reports a failed write as `RuntimeError: [enforce fail at inline_container.cc] unexpected pos`,
    safetensors as a `SafetensorError`, neither naming the folder), the original error itself when writing into the
    folder works (the failure was something else). With `remove`, the partial folder (a staging
    folder: the checkpoints in place are untouched) is deleted to give the space back."""
    import errno as errno_names

    code = error.errno if isinstance(error, OSError) and error.errno else _write_errno(folder)
    if code is None:
        return error
    if remove:
        shutil.rmtree(folder, ignore_errors=True)
    name = errno_names.errorcode.get(code, str(code))
    limit = " (the file-size limit, `ulimit -f`)" if code == errno_names.EFBIG else ""
    return OSError(
        code,
        f"saving the checkpoint failed writing {folder}: {os.strerror(code)} [errno {code} {name}]{limit}; "
        f"{'the partial folder was removed and ' if remove else ''}the previous checkpoints are intact "
        f"({type(error).__name__}: {str(error)[:200]})",
    )


def _raise_save_error(folder: str, error: Exception, remove: bool):
    better = save_error(folder, error, remove)
    if better is error:
        raise error
    raise better from error


def uses_staging(args) -> bool:
    """With `push_to_hub` and `hub_strategy` "checkpoint" / "all_checkpoints" the Trainer uploads the checkpoint
    folder in the background by its path, so it is written in place (the pipeline state last), as the Trainer does."""
    strategy = getattr(args.hub_strategy, "value", args.hub_strategy)
    return not (args.push_to_hub and strategy in ("checkpoint", "all_checkpoints"))


def atomic_save(save, *, run_dir: str, state, args, pipeline_state: dict, barrier, staging) -> None:
    """Run the Trainer's `save()` into the staging folder (`staging(True)` redirects its output dir), add the
    pipeline state, rename the folder into place (main process) and only then rotate old checkpoints.

    `state` is the Trainer's `TrainerState` (its best checkpoint is moved with the folder), `barrier` waits for every
    process, `args` the `TrainingArguments` (`should_save`, `save_total_limit`).
    """
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    if not uses_staging(args):
        staging(False)
        folder = os.path.join(run_dir, name)
        try:
            save()
            if args.should_save:
                write_pipeline_state(folder, pipeline_state)
        except Exception as e:
            _raise_save_error(folder, e, remove=False)
        return
    staged = os.path.join(run_dir, SAVING_DIR, name)
    if args.should_save:
        clear_staged(run_dir, name)
    barrier()
    staging(True)
    try:
        save()
    except Exception as e:
        _raise_save_error(staged, e, remove=args.should_save)
    finally:
        staging(False)
    best = state.best_model_checkpoint
    staging_root = os.path.join(run_dir, SAVING_DIR)
    if best and os.path.dirname(os.path.abspath(best)) == os.path.abspath(staging_root):
        state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))  # where it will be
        if args.should_save:
            state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
    if args.should_save:
        try:
            write_pipeline_state(staged, pipeline_state)
        except Exception as e:
            _raise_save_error(staged, e, remove=True)
    barrier()  # every process's files (rng states, shards) are in `staged`
    if args.should_save:
        move_into_place(run_dir, name, args.save_total_limit, state.best_model_checkpoint)
    barrier()
