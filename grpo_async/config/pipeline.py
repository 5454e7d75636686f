"""Pipeline fields of `GRPOConfig`: per-stage micro-batches, reuse order, and the async generation queue."""

from dataclasses import dataclass, field
from typing import Literal

from .checks import Number, checked_field

#: orders of the μ passes over a round (`grpo_async.pipeline.rows.reuse_order` implements them)
REUSE_ORDERS = ("epoch", "consecutive")
#: rows (after the ×G repeat) per chunk of a stage; `None`: per_device_train_batch_size
ROWS = Number(ge=1, integer=True, optional=True, what="an int >= 1 (rows, counted after the ×G repeat) or None")


@dataclass
class PipelineFields:
    """How a round flows: rollout / ref-logps / old-logps chunk sizes, μ-pass order, rounds ahead, staleness."""

    rollout_micro_batch_size: int | None = checked_field(
        ROWS,
        default=None,
        metadata={
            "help": "Completions per generate call (rows after the ×G repeat), over the rows a process generates: "
            "the whole round on the main process, or with an engine on every rank (hf, in-process vllm, several "
            "processes) each rank's generation_batch_size / processes rows (a last call may be shorter); must "
            "divide generation_batch_size. Default: per_device_train_batch_size. vLLM batches internally: set it "
            "to generation_batch_size for one call per round.",
        },
    )
    ref_logps_micro_batch_size: int | None = checked_field(
        ROWS,
        default=None,
        metadata={
            "help": "Rows per reference-model forward pass, on each process over its generation_batch_size / "
            "processes rows (must divide them). Default: per_device_train_batch_size.",
        },
    )
    old_logps_micro_batch_size: int | None = checked_field(
        ROWS,
        default=None,
        metadata={
            "help": "Rows per old-policy forward pass, on each process over its generation_batch_size / processes "
            "rows (must divide them). Default: per_device_train_batch_size.",
        },
    )
    token_budget: int | None = checked_field(
        Number(ge=1, integer=True, optional=True, what="an int >= 1 (tokens per forward pass, per device) or None"),
        default=None,
        metadata={
            "help": "TRL async's name: token positions per forward pass, per device: the packed rows' tokens and "
            "the filler of their bins (padding_free packs rows into bins as long as the longest row; the budget "
            "bounds the [bins, width] the model runs). Each old-logps and ref-logps forward pass holds as many "
            "consecutive rows as fit (instead of its micro-batch size in rows), and each training micro-batch runs "
            "as consecutive slices that fit, forward and backward in turn, with the loss type's normaliser over the "
            "whole micro-batch (same gradients). A row longer than the budget is an error. Not with "
            "top_entropy_quantile < 1 or the MoE load-balancing loss. None (default): rows, as the micro-batch "
            "sizes say.",
        },
    )
    reuse_order: Literal["epoch", "consecutive"] = field(
        default="epoch",
        metadata={
            "help": f"Order of the μ passes over a round's micro-batches, one of {REUSE_ORDERS}: 'epoch' (a b | a b) "
            "or 'consecutive' (a a b b: each micro-batch trained μ times in a row)."
        },
    )

    num_batches_ahead: int = checked_field(
        Number(ge=0, integer=True, what="an int >= 0 (0 = synchronous)"),
        default=1,
        metadata={
            "help": "Rounds generated ahead of training (0 = synchronous). Staleness is counted in policy versions "
            "(optimizer steps): with k rounds ahead a sample lags at most ceil(k × steps_per_round) versions when "
            "its round starts (see max_staleness).",
        },
    )
    async_generation_timeout: float = checked_field(
        Number(gt=0, what="> 0 seconds"),
        default=600.0,
        metadata={
            "help": "Seconds any wait on the generator may last before raising; a round generated on the trainer's "
            "own thread (a waited round with `hf` or the in-process vLLM engine) is aborted at it."
        },
    )
    max_staleness: int | None = checked_field(
        Number(ge=0, integer=True, optional=True, what="an int >= 0 (policy versions, i.e. optimizer steps) or None"),
        default=None,
        metadata={
            "help": "Most policy versions (optimizer steps) a sample may lag: a sample generated from the weights of "
            "step v and trained in a round starting from the weights of step s has staleness s - v; staler samples "
            "are not trained (loss mask zeroed, counted in async/dropped_stale). A sample's version is its oldest "
            "token's (with in-flight weight updates a completion's tokens span versions). Default: what the "
            "pipeline can produce, ceil(num_batches_ahead × steps_per_round), so nothing is dropped; in stream mode "
            "no limit (a "
            "straggler group keeps generating while the trainer moves on); when the sampler never "
            "receives weights (weight_sync_transport='none', or the openai backend without 'checkpoint_dir') there "
            "is no limit and it must stay unset.",
        },
    )
    staleness_policy: Literal["pace", "drop"] = field(
        default="pace",
        metadata={
            "help": "What max_staleness does when it is set (or, in rounds mode, its default). 'pace' (default): the "
            "generator does not start a round (rounds mode) or a prompt group (stream mode) whose rows would lag more"
            " than max_staleness versions when their round starts training; it waits for the trainer's next weights "
            "instead (async/pace_wait_s), so rows are not generated only to be dropped; in stream mode a round also "
            "waits for a running group it is the last round to train within the limit (the trainer waits for a "
            "straggler rather than drop it). The drop stays as a guard (async/dropped_stale: groups beyond what a "
            "round holds, or started late by the bounded waits). 'drop': generate as far ahead as num_batches_ahead /"
            " max_inflight_groups allow and drop the stale rows when their round is trained. Default 'pace', from "
            "bench/streaming.py (stream, long-tailed lengths, max_staleness=2): 'drop' discarded 22 percent of the "
            "rows it generated, the long ones (stragglers go stale), so the trained rows averaged 0.40x the generated "
            "length; 'pace' dropped none (trained = generated lengths) and trained 1.97x the tokens per second, its "
            "steps 1.2-1.5x longer (the trainer waits for stragglers).",
        },
    )
    async_mode: Literal["rounds", "stream"] = field(
        default="rounds",
        metadata={
            "help": "How the generator feeds the trainer. 'rounds': whole rounds, one generate job per round; a round "
            "is ready when its slowest completion is. 'stream': prompt groups are submitted to the engine "
            "continuously (up to max_inflight_groups), a group is scored as soon as its G completions are done, and "
            "each training round takes the groups that finished first (in order of readiness), so a long completion "
            "delays only its own group (pipeline/group_stream.py). Backends: vllm (in-process), vllm_server, openai; "
            "the hf backend is round-based. See docs/async_pipeline.md for what determinism still holds.",
        },
    )
    max_inflight_groups: int | None = checked_field(
        Number(ge=1, integer=True, optional=True, what="an int >= 1 (prompt groups generating at once) or None"),
        default=None,
        metadata={
            "help": "async_mode='stream': most prompt groups (each G completions) generating or being scored at "
            "once; the trainer keeps the stream that full, submitting max(num_batches_ahead, ceil(max_inflight_groups "
            "/ groups per round)) rounds ahead of the one it trains (GRPOConfig.rounds_ahead), and each round takes "
            "the groups that finished first. Default: (num_batches_ahead + 1) × generation_batch_size / "
            "num_generations, so num_batches_ahead + 1 rounds ahead. Read in stream mode only.",
        },
    )
    async_max_queue_size: int | None = checked_field(
        Number(ge=1, integer=True, optional=True),
        default=None,
        metadata={"help": "Rounds queued or completed-unfetched at once. Default num_batches_ahead+2."},
    )
