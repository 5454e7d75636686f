"""`GRPOConfig`: every knob of the trainer, grouped by concern, validated at construction.

The fields are declared in one dataclass per concern and joined here; `__post_init__` runs the steps in order:

```txt
TRL's spellings (bf16=None, min_p=None, scale_rewards=True)  →  TrainingArguments.__post_init__
  →  per-field constraints (checks.py)  →  derived fields (marked, see derived.py)  →  cross-field rules (rules.py)
```
A config is a value: `__post_init__` never overwrites what the user gave with a value derived from other fields. A
derived value (e.g. `generation_batch_size` when only `per_device_train_batch_size` was set) is stored marked as
derived, so `dataclasses.replace(cfg, per_device_train_batch_size=8)` derives it again instead of keeping the stale
number.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..algo.loss import combination_warnings
from .checks import Number, check_fields, config_error
from .completions import CompletionLogFields
from .derived import derived, given
from .generation import GenerationFields
from .loss import LossFields
from .model import ModelFields
from .pipeline import PipelineFields
from .reference import ReferenceFields
from .rules import STAGES, check_rules
from .trl_compat import TRL_ALIASES, TRLKeywords, alias_property, check_trl_fields
from .trl_fields import TRLFields
from .weight_sync import WeightSyncFields

#: the field groups, in the order their fields are declared (and documented)
FIELD_GROUPS = (
    ModelFields,
    GenerationFields,
    WeightSyncFields,
    PipelineFields,
    LossFields,
    ReferenceFields,
    CompletionLogFields,
    TRLFields,
)
#: constraints on `TrainingArguments` fields the batch geometry reads
TRAINING_ARGUMENTS_CHECKS = {
    "per_device_train_batch_size": Number(ge=1, integer=True),
    "gradient_accumulation_steps": Number(ge=1, integer=True),
}
#: fields holding credentials: redacted from `to_dict` (logging integrations), `repr` and pickles (training_args.bin)
SECRET_FIELDS = ("vllm_api_key", "ref_server_api_key")


def _redacted(d: dict) -> dict:
    return {**d, **{k: f"<{k.upper()}>" for k in SECRET_FIELDS if d.get(k) is not None}}


@dataclass
class GRPOConfig(*reversed(FIELD_GROUPS), TrainingArguments, metaclass=TRLKeywords):
    r"""Configuration of [`GRPOTrainer`]; all [`~transformers.TrainingArguments`] fields apply as well.

    Batch geometry (G = `num_generations`, μ = `num_iterations`, N = processes):

    ```txt
    generation round = per_device_train_batch_size × N × steps_per_generation rows  (= prompts × G)
    one round is generated every steps_per_generation × μ micro-steps, trained μ times (epoch order: a b | a b)
    optimizer steps per round (steps_per_round) = steps_per_generation × μ / gradient_accumulation_steps
    ```

    Names and defaults follow TRL 1.16's `GRPOConfig` wherever TRL has the same knob, so a TRL config ports by
    changing the import: every field of `trl.GRPOConfig` is accepted (see `trl_compat`).
    """

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [
        "model_init_kwargs",
        "generation_kwargs",
        "chat_template_kwargs",
        "transformers_continuous_batching_config",
    ]

    # ---- overridden TrainingArguments defaults -------------------------------------------------------------
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate (TRL's GRPO default)."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X optimizer steps."})
    remove_unused_columns: bool | None = field(
        default=False, metadata={"help": "Keep dataset columns: they are passed to the reward functions."}
    )

    def __post_init__(self):
        if self.bf16 is None:  # TRL: None means bf16 unless fp16
            self.bf16 = not self.fp16
        self._check_unsupported()  # before TrainingArguments, which would fail on use_liger_kernel without Liger
        super().__post_init__()
        if self.min_p is None:  # TRL's "off"
            self.min_p = 0.0
        if isinstance(self.scale_rewards, bool):  # TRL's booleans
            self.scale_rewards = "group" if self.scale_rewards else "none"
        check_fields(self, TRAINING_ARGUMENTS_CHECKS)
        self._derive()
        check_rules(self)
        for message in combination_warnings(self.loss_type, self.importance_sampling_level):
            warnings.warn(f"GRPOConfig: {message}", UserWarning, stacklevel=4)  # the caller of GRPOConfig(...)

    # ---- construction steps ------------------------------------------------------------------------------
    def _check_unsupported(self) -> None:
        """TRL fields at anything but TRL's default, and `TrainingArguments` features the round cannot follow."""
        check_trl_fields(self)
        if self.auto_find_batch_size:
            raise config_error(
                "auto_find_batch_size",
                "not supported: the generation round must hold whole groups of num_generations completions, and "
                "halving the batch on out-of-memory breaks that; set it to False and lower "
                "per_device_train_batch_size instead",
            )
        pc = getattr(self, "parallelism_config", None)
        if pc is not None and (getattr(pc, "cp_enabled", False) or getattr(pc, "sp_enabled", False)):
            raise config_error(
                "parallelism_config",
                "sequence-dim parallelism (cp_size > 1 or sp_size > 1) is not supported: the model inputs are built "
                "after generation; set cp_size=1 and sp_size=1",
            )

    def _derive(self) -> None:
        """Set every field the user left to be derived (marked as derived; see `derived.py`).

        `generation_batch_size` and `steps_per_generation` follow TRL's rules: from whichever the user set, else
        `steps_per_generation = gradient_accumulation_steps`; the rules check that both agree when both are given.
        """
        self.epsilon_high = given(self.epsilon_high)
        if self.epsilon_high is None:
            self.epsilon_high = derived(float(self.epsilon))
        self.generation_backend = given(self.generation_backend)
        if self.generation_backend is None:
            if self.openai_base_url:
                backend = "openai"
            elif self.use_vllm:
                backend = "vllm" if self.vllm_mode == "colocate" else "vllm_server"
            else:
                backend = "hf"
            self.generation_backend = derived(backend)
        micro = self.global_micro_batch_size
        gbs, spg = given(self.generation_batch_size), given(self.steps_per_generation)
        if gbs is None:
            spg = spg if spg is not None else derived(self.gradient_accumulation_steps)
            gbs = derived(micro * spg)
        elif spg is None:
            spg = derived(gbs // micro)
        self.generation_batch_size, self.steps_per_generation = gbs, spg
        self.max_inflight_groups = given(self.max_inflight_groups)
        if self.max_inflight_groups is None:  # every group of the rounds the pipeline holds (stream mode)
            groups = max(1, self.generation_batch_size // max(1, self.num_generations))
            self.max_inflight_groups = derived((self.num_batches_ahead + 1) * groups)
        self.async_max_queue_size = given(self.async_max_queue_size)
        if self.async_max_queue_size is None:
            self.async_max_queue_size = derived(self.rounds_ahead + 2)
        for name in STAGES:
            if given(getattr(self, name)) is None:
                setattr(self, name, derived(self.per_device_train_batch_size))

    # ---- secrets: never written out ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """`TrainingArguments.to_dict` (what TensorBoard, wandb, mlflow, ... receive) with the API keys replaced by
        `"<FIELD_NAME>"`, as transformers replaces its `*_token` fields."""
        return _redacted(super().to_dict())

    def __str__(self) -> str:  # TrainingArguments.__str__, with the API keys masked too
        d = {k: f"<{k.upper()}>" if k.endswith("_token") else v for k, v in dataclasses.asdict(self).items()}
        attrs = "".join(f"{k}={v},\n" for k, v in sorted(_redacted(d).items()))
        return f"{type(self).__name__}(\n{attrs})"

    __repr__ = __str__

    def __getstate__(self) -> dict:
        """Pickled (the Trainer's `training_args.bin` in every checkpoint, uploaded with it): without the API keys.
        A config read back from it has `"<VLLM_API_KEY>"` there: set the keys again to use it against a server."""
        return _redacted(dict(self.__dict__))

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):  # in-process copies keep the keys
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    # ---- derived, read-only ------------------------------------------------------------------------------
    @property
    def server_urls(self) -> list[str]:
        """The generation servers: `vllm_server_urls`, then `vllm_server_base_url`, de-duplicated (order kept); with
        the vllm_server backend and no URL given, TRL's `http://vllm_server_host:vllm_server_port`."""
        urls = list(self.vllm_server_urls or [])
        if self.vllm_server_base_url:
            urls.append(self.vllm_server_base_url)
        if not urls and self.generation_backend == "vllm_server":
            urls.append(f"http://{self.vllm_server_host}:{self.vllm_server_port}")
        out, seen = [], set()
        for u in urls:
            key = str(u).rstrip("/")
            if key not in seen:
                seen.add(key)
                out.append(u)
        return out

    @property
    def syncs_weights(self) -> bool:
        """Whether the sampler ever receives the trainer's weights: not with `weight_sync_transport='none'`, nor with
        the openai backend unless it reloads a shared checkpoint folder (`'checkpoint_dir'`)."""
        if self.weight_sync_transport == "none":
            return False
        if self.generation_backend == "openai":
            return self.weight_sync_transport == "checkpoint_dir"
        return True

    @property
    def steps_per_round(self) -> float:
        """Optimizer steps per generation round: `steps_per_generation × num_iterations / gradient_accumulation_steps`
        (may be fractional: a round can end inside an accumulation window)."""
        return self.steps_per_generation * self.num_iterations / self.gradient_accumulation_steps

    @property
    def rounds_ahead(self) -> int:
        """Rounds submitted to the generator ahead of the one being trained.

        `async_mode="rounds"`: `num_batches_ahead`. `"stream"`: enough rounds that the stream holds
        `max_inflight_groups` prompt groups while a round trains, `max(num_batches_ahead, ceil(max_inflight_groups /
        groups per round))`; with the default `max_inflight_groups`, `num_batches_ahead + 1`. A training round is
        assembled from the groups that finished first among them, so the engine keeps generating the next groups
        while a straggler finishes (with only the next round's groups in flight a round would wait for its slowest
        group, as in rounds mode).

        ```txt
        num_batches_ahead = 1, 8 groups a round, max_inflight_groups = 16 (default) → 2 rounds ahead:
        training round k ─ the stream holds the groups of rounds k+1 and k+2 (16) ─ round k+1 = the first 8 ready
        ```
        """
        if self.async_mode != "stream":
            return self.num_batches_ahead
        groups = max(1, self.generation_batch_size // max(1, self.num_generations))
        return max(self.num_batches_ahead, -(-self.max_inflight_groups // groups))

    @property
    def staleness_limit(self) -> int | None:
        """Most policy versions (optimizer steps) a trained sample may lag (see `max_staleness`), or `None`: no limit.

        `max_staleness` if set; else, when the sampler receives weights in rounds mode, the most the pipeline produces,
        `ceil(num_batches_ahead × steps_per_round)` (nothing is dropped by default); else `None` (the sampler never
        updates, or stream mode, where a long group keeps generating while the trainer moves on: samples are
        corrected by importance sampling, nothing is dropped).
        """
        if self.max_staleness is not None:
            return self.max_staleness
        if not self.syncs_weights or self.async_mode == "stream":  # stream: a straggler group may lag any number of
            return None  # versions (it keeps generating while others train); it is corrected, not dropped

        # integer form of ceil(num_batches_ahead * steps_per_round): no float rounding
        num = self.num_batches_ahead * self.steps_per_generation * self.num_iterations
        return -(-num // self.gradient_accumulation_steps)

    @property
    def global_micro_batch_size(self) -> int:
        """Rows trained per micro-step across all processes."""
        return self.per_device_train_batch_size * self.world_size


for _trl_name, _ours in TRL_ALIASES.items():
    setattr(GRPOConfig, _trl_name, alias_property(_ours))
del _trl_name, _ours
