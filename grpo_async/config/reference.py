"""Memory and reference-model fields of `GRPOConfig`: packing, the reference model (local, remote, TR-DPO)."""

from dataclasses import dataclass, field


@dataclass
class ReferenceFields:
    """Padding-free packing of the forward passes, and where the reference log-probs come from."""

    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Run the logps and training forward passes without padding: each micro-batch's rows packed, "
            "longest first, into bins no longer than its longest row (position ids reset per row; logits only at "
            "completion tokens). Same numbers as the padded path, never more attention work; much less memory and "
            "time when lengths are skewed (one long completion among short ones), as in RL. Needs a model whose "
            "attention isolates packed rows (restarting position ids); the trainer checks this at start. None "
            "(default): packed when the model isolates packed rows, else padded with a warning (e.g. OPT, Bloom, "
            "Falcon); True: packed, or an error naming the model; False: padded."
        },
    )
    share_prompt_prefix: bool = field(
        default=True,
        metadata={
            "help": "Compute the prompt of a group once in the logps and training forward passes: the rows of a "
            "forward pass that share a prompt run as one row [prompt, completion 1, ..., completion k] whose "
            "completions attend to the prompt and to themselves only (a tree attention mask, per-branch position "
            "ids; grpo_async/algo/prefix_sharing.py). Same log-probs, loss and gradients as unshared (1e-12 in "
            "float64; in float32 within the summation-order noise of the unshared path itself); a cost model groups "
            "the completions into the rows that cost least, so long completions behind a short prompt stay "
            "unshared. Where it changes no optimizer step, a round is dealt to micro-batches in whole groups so the "
            "training forward shares each prompt (pipeline.consumer.keep_groups_together). Needs an attention that "
            "takes a 4D mask (sdpa, eager): with FlashAttention or FlexAttention, sliding-window attention, or a "
            "model found to ignore the mask: one warning and unshared rows."
        },
    )
    ref_server_url: str | None = field(
        default=None,
        metadata={
            "help": "Base URL of a `grpo-async serve` server holding the frozen reference weights (never updated): "
            "with beta > 0 the reference logps come from it and the trainer loads no reference model."
        },
    )
    ref_server_api_key: str | None = field(
        default=None, metadata={"help": "API key of the reference server. Default: vllm_api_key."}
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "Whether to synchronize the reference model with the active model every `ref_model_sync_steps` "
            "steps, using the `ref_model_mixup_alpha` parameter (TR-DPO). Needs beta > 0 and a reference model "
            "in this process: not with PEFT or ref_server_url."
        },
    )
    ref_model_mixup_alpha: float = field(
        default=0.6,
        metadata={
            "help": "α parameter from the TR-DPO paper, which controls the mix between the current policy and the "
            "previous reference policy during updates. The reference policy is updated according to the equation: "
            "`π_ref = α * π_θ + (1 - α) * π_ref_prev`. To use this parameter, you must set `sync_ref_model=True`."
        },
    )
    ref_model_sync_steps: int = field(
        default=512,
        metadata={
            "help": "τ parameter from the TR-DPO paper, which determines how frequently the current policy is "
            "synchronized with the reference policy. To use this parameter, you must set `sync_ref_model=True`."
        },
    )
