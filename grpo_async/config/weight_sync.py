"""Weight-sync fields of `GRPOConfig`: how the trainer's weights reach the sampler."""

from dataclasses import dataclass, field
from typing import Literal

from ..weight_sync.names import SYNC_SETTINGS, SyncSetting
from .checks import Number, checked_field


@dataclass
class WeightSyncFields:
    """The transport (the backend registry says which each backend takes), bucket size, in-flight updates, LoRA."""

    weight_sync_transport: SyncSetting = field(
        default="auto",
        metadata={
            "help": f"One of {SYNC_SETTINGS} (see grpo_async.weight_sync.names); 'auto' picks the best the backend "
            "supports (with the openai "
            "backend: no sync); 'none': the sampler keeps its initial weights."
        },
    )
    weight_sync_bucket_mb: float = checked_field(
        Number(gt=0),
        default=256.0,
        metadata={"help": "Size threshold of a weight-transfer bucket (modules are never split)."},
    )
    weight_sync_inflight: bool = field(
        default=False,
        metadata={
            "help": "vllm_server only: push new weights as soon as the optimizer made them, while the round in flight "
            "keeps generating (its running requests continue on the new weights). Off: a round finishes on the "
            "weights it started with. Samples record the version their round started with."
        },
    )
    weight_sync_delta: bool = field(
        default=False,
        metadata={
            "help": "vllm_server (grpo-async serve) only: a weight push sends only the values that changed in the "
            "engine's dtype since the last push the server acknowledged (per tensor: nothing, flat indices + values, "
            "a bitmask + values, or the whole tensor, whichever is smallest), checked by a checksum; a full push on "
            "the first sync, after a failed or aborted one, to a restarted server and every "
            "weight_sync_delta_full_every pushes. Worth it with a lower-precision engine (a bfloat16 server: most "
            "bf16 values do not move in an RL step) on a slow link; it costs the trainer one copy of the weights in "
            "the engine's dtype (2 bytes per parameter in bf16), and each server another. Refused by the in-process "
            "backends (hf, vllm: nothing moves), openai and stock vLLM servers. See grpo_async.weight_sync.delta."
        },
    )
    weight_sync_delta_full_every: int = checked_field(
        Number(ge=1, integer=True),
        default=50,
        metadata={"help": "With weight_sync_delta: every this-many-th push to a server is whole (1: every push)."},
    )
    vllm_lora_sync: Literal["auto", "adapter", "merged"] = field(
        default="auto",
        metadata={
            "help": "With a PEFT LoRA adapter (peft_config), what a weight sync sends to vLLM: 'adapter' (only the "
            "adapter's lora_A/lora_B tensors; the sampler serves base + LoRA with a new adapter per policy version "
            "and its base weights never move; a vllm_server must run with --enable-lora --max-lora-rank R), "
            "'merged' (merge the adapter, push every full weight, unmerge) or 'auto' ('adapter' for the in-process "
            "vllm backend when vLLM can serve the adapter (LoRA, no DoRA, bias or modules_to_save), else 'merged')."
        },
    )
