"""Construction-time checks and process-group helpers of `GRPOTrainer` (no Trainer reference here)."""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING

import torch

from .pipeline.producer import is_conversational

if TYPE_CHECKING:
    from .config import GRPOConfig

_PEER_FAILURE_SIGNS = ("connection closed by peer", "connection reset by peer", "gloo", "nccl")


def is_peer_failure(e: BaseException) -> bool:
    """A collective failed because another process died or stalled (gloo/NCCL errors, store timeouts); not an error
    of our own pipeline (generation, rewards) that merely mentions one."""
    if str(e).startswith("Async generation"):
        return False
    dist_error = getattr(torch.distributed, "DistError", ())
    return isinstance(e, dist_error) or any(s in str(e).lower() for s in _PEER_FAILURE_SIGNS)


def peer_failure_error(e: BaseException, accelerator, micro_step: int, global_step: int, args) -> RuntimeError:
    return RuntimeError(
        f"process {accelerator.process_index} of {accelerator.num_processes}: a collective with "
        f"the other training processes failed at micro-step {micro_step} (global step {global_step}): a peer process "
        f"died, or did not answer within ddp_timeout={args.ddp_timeout}s; see the other processes' logs for the "
        f"first error ({type(e).__name__}: {str(e)[:300]})"
    )


def bound_collectives(num_processes: int, ddp_timeout: float) -> None:
    """Every collective (DDP all-reduce, the pipeline's gather/broadcast of rounds) waits at most `ddp_timeout`
    seconds for the other processes. transformers passes `ddp_timeout` to the process group on GPU only; on CPU
    (gloo) the group would keep torch's 30-minute default, so a stalled peer would hang the others that long."""
    dist = torch.distributed
    if num_processes > 1 and dist.is_available() and dist.is_initialized():
        from datetime import timedelta

        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=ddp_timeout))


def default_args(model, args):
    """TRL's default when `args` is omitted: a `GRPOConfig` writing to `<model name>-GRPO`."""
    from .config import GRPOConfig

    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        args = GRPOConfig(output_dir=f"{str(name).split('/')[-1]}-GRPO")
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"args must be a grpo_async.GRPOConfig, got {type(args).__name__}")
    return args


def reward_weights_tensor(weights: list[float] | None, num_funcs: int) -> torch.Tensor:
    """`[F]` weights of the reward functions (all 1 when not given)."""
    if weights is not None and len(weights) != num_funcs:
        raise ValueError(f"GRPOConfig.reward_weights has {len(weights)} values for {num_funcs} reward functions")
    return torch.tensor(weights or [1.0] * num_funcs, dtype=torch.float32)


def is_iterable(dataset) -> bool:
    """A streaming dataset (`datasets.IterableDataset`, or any torch `IterableDataset`): no `len()`, no indexing."""
    from torch.utils.data import IterableDataset

    return isinstance(dataset, IterableDataset)


def check_dataset(dataset, args: GRPOConfig, name: str, min_rows: int | None = None) -> None:
    """The earliest checks of a train/eval set: a 'prompt' column, enough prompts for one round; a streaming train set
    needs `max_steps` (its length is unknown), `dispatch_batches=False` (each process reads its own slice of the
    stream, as TRL) and one dataloader worker (several would interleave the stream and split the G copies)."""
    if isinstance(dataset, dict):  # several eval sets by name (a dict or a `datasets.DatasetDict`, as TRL takes)
        for key, ds in dataset.items():
            check_dataset(ds, args, f"{name}[{key!r}]", min_rows)
        return
    if is_iterable(dataset):
        columns = getattr(dataset, "column_names", None)  # None when the stream's features are unknown
        if columns is not None and "prompt" not in columns:
            raise ValueError(f"{name} needs a 'prompt' column (text or chat messages); it has {columns}")
        if name == "train_dataset" and args.max_steps <= 0:
            raise ValueError(
                "train_dataset is an IterableDataset (a stream of unknown length): set GRPOConfig.max_steps to a "
                "positive number of optimizer steps"
            )
        if args.accelerator_config.dispatch_batches:
            raise ValueError(
                f"{name} is an IterableDataset, which needs accelerator_config.dispatch_batches=False (each process "
                "reads its own slice of the stream); it is set to True"
            )
        args.accelerator_config.dispatch_batches = False
        if name == "train_dataset" and args.dataloader_num_workers != 0:
            warnings.warn(
                f"train_dataset is an IterableDataset: dataloader_num_workers={args.dataloader_num_workers} would "
                "interleave the stream and split each prompt's num_generations copies; using 0 (as TRL does)",
                stacklevel=3,
            )
            args.dataloader_num_workers = 0
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None and len(dataset):
        columns = list(dataset[0].keys())
    if columns is not None and "prompt" not in columns:
        raise ValueError(f"{name} needs a 'prompt' column (text or chat messages); it has {columns}")
    need = min_rows if min_rows is not None else args.generation_batch_size // args.num_generations
    if len(dataset) < need:
        raise ValueError(
            f"{name} has {len(dataset)} prompts but one generation round needs {need} "
            f"(generation_batch_size={args.generation_batch_size} / num_generations={args.num_generations})"
        )


def train_stream(dataset, args: GRPOConfig):
    """What the train dataloader reads: a map-style set as it is (`RepeatSampler` orders it); a stream shuffled
    (buffered, seeded) and reordered into the sampler's order by `repeat_iterable`."""
    if not is_iterable(dataset):
        return dataset
    from .data.sampler import repeat_iterable

    if args.shuffle_dataset:
        dataset = dataset.shuffle(seed=args.seed)
    return repeat_iterable(
        dataset,
        mini_repeat_count=args.num_generations,
        batch_size=args.generation_batch_size // args.num_generations,
        repeat_count=args.num_iterations * args.steps_per_generation,
    )


def make_environment(environment, tools, *datasets):
    from .envs import ToolEnv, check_environment

    if tools is not None:
        if environment is not None:
            raise ValueError("give either environment= or tools= (tools=[...] is environment=ToolEnv([...]))")
        environment = ToolEnv(tools)
    if environment is None:
        return None
    check_environment(environment)
    datasets = [d for ds in datasets for d in (ds.values() if isinstance(ds, dict) else [ds])]  # eval sets by name
    for ds in datasets:
        if ds is None:
            continue
        first = next(iter(ds), None) if is_iterable(ds) else (ds[0] if len(ds) else None)
        if first is not None and not is_conversational(first["prompt"]):
            raise ValueError(
                "a multi-turn environment needs conversational prompts (lists of chat messages); the dataset's "
                f"first prompt is {first['prompt']!r:.100}"
            )
    return environment


def prepare_models(model, args: GRPOConfig, processing_class, peft_config):
    """Load what was named, check the tokenizer, build the reference (a frozen copy; none with PEFT, whose base
    model with the adapter disabled is the reference, or with a reference server), wrap PEFT, drop dropout, prove
    packed rows stay isolated, and refuse a model the in-process vLLM engine cannot serve.

    Returns `(model, processing_class, ref_model or None)`.
    """
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from .algo.packing import check_isolation
    from .loading import load_model, load_tokenizer

    if args.sync_ref_model and peft_config is not None:  # TRL 1.16 refuses it the same way
        raise NotImplementedError(
            "GRPOConfig.sync_ref_model=True with a peft_config is not supported (as in TRL): with PEFT the reference "
            "is the base model with the adapter disabled, so there is no separate reference model to synchronise; "
            "set sync_ref_model=False, or train without PEFT"
        )
    model_id = model if isinstance(model, str) else model.config._name_or_path
    if isinstance(model, str):
        kwargs = dict(args.model_init_kwargs or {})
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        model = load_model(model, **kwargs)
    elif args.model_init_kwargs:
        raise ValueError("GRPOConfig.model_init_kwargs only applies when `model` is a name or path")
    if processing_class is None:
        processing_class = load_tokenizer(model_id, trust_remote_code=args.trust_remote_code)
    if getattr(processing_class, "pad_token", None) is None:
        raise ValueError(
            f"The tokenizer of {model_id!r} has no pad token. Set one before creating the trainer, e.g. "
            "`tokenizer.pad_token = tokenizer.eos_token`."
        )
    processing_class.padding_side = "left"

    is_peft = peft_config is not None
    ref_model = None
    # the reference: a frozen server (ref_server_url), the PEFT base model, or a frozen copy of the policy
    if args.beta > 0 and not is_peft and args.ref_server_url is None:
        ref_model = copy.deepcopy(model).eval()
        for p in ref_model.parameters():
            p.requires_grad_(False)
    if is_peft:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    if args.disable_dropout:
        for m in list(model.modules()) + (list(ref_model.modules()) if ref_model is not None else []):
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    # packed rows must not attend to each other: prove it on this model once (not under ZeRO-3, whose parameters
    # are partitioned from `from_pretrained` on: a forward needs the DeepSpeed engine, and gathering them whole
    # on every rank would defeat ZeRO-3)
    if args.padding_free and not is_deepspeed_zero3_enabled():
        was_training = model.training
        check_isolation(model.eval())
        model.train(was_training)

    if args.generation_backend == "vllm":  # the in-process engine starts later: refuse what it cannot serve now
        from .generation.vllm_backends import check_vllm_can_serve

        check_vllm_can_serve(model.config, "GRPOConfig.generation_backend='vllm'")
    return model, processing_class, ref_model


def producer_settings(a: GRPOConfig):
    from .generation.base import SamplingConfig
    from .pipeline.producer import ProducerSettings

    sampling = SamplingConfig(
        max_tokens=a.max_completion_length, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p
    )
    sampling.stop = a.stop
    return ProducerSettings(
        num_generations=a.num_generations,
        sampling=sampling,
        max_completion_length=a.max_completion_length,
        max_prompt_length=a.max_prompt_length,
        prompt_truncation=a.prompt_truncation,
        rollout_micro_batch_size=a.rollout_micro_batch_size,
        scale_rewards=a.scale_rewards,
        multi_objective_aggregation=a.multi_objective_aggregation,
        num_generations_eval=a.num_generations_eval or a.num_generations,  # TRL: None means num_generations
        mask_truncated_completions=a.mask_truncated_completions,
        mask_env_responses=a.mask_env_responses,
        reward_timeout=a.reward_timeout,
        syncs_weights=a.syncs_weights,
        seed=None,  # per-request seeds crash vLLM CPU on chunked prefill ("CPU Generator does not use offset")
    )


def eval_chunk_prompts(a: GRPOConfig) -> int:
    """Prompts generated and scored together by `evaluate`: TRL's global eval batch, `per_device_eval_batch_size ×
    processes` rows, in whole groups of `num_generations_eval` completions (at least one prompt)."""
    return max(1, a.per_device_eval_batch_size * a.world_size // (a.num_generations_eval or a.num_generations))


def consumer_settings(a: GRPOConfig):
    from .pipeline.consumer import ConsumerSettings

    return ConsumerSettings(
        steps_per_generation=a.steps_per_generation,
        old_logps_micro_batch_size=a.old_logps_micro_batch_size,
        ref_logps_micro_batch_size=a.ref_logps_micro_batch_size,
        staleness_limit=a.staleness_limit,
        importance_sampling_correction=a.importance_sampling_correction,
        importance_sampling_mode=a.importance_sampling_mode,
        importance_sampling_clip_min=a.importance_sampling_clip_min,
        importance_sampling_clip_max=a.importance_sampling_clip_max,
    )


def scheduler_settings(a: GRPOConfig):
    from .pipeline.scheduler import SchedulerSettings

    return SchedulerSettings(
        steps_per_generation=a.steps_per_generation,
        num_iterations=a.num_iterations,
        num_batches_ahead=a.num_batches_ahead,
        reuse_order=a.reuse_order,
        max_queue_size=a.async_max_queue_size,
        generation_timeout=a.async_generation_timeout,
    )


class ProducerAttribute:
    """A trainer attribute (TRL's name: `reward_funcs`, ...) that reads and writes `trainer.producer.<name>`."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, trainer, owner=None):
        return self if trainer is None else getattr(trainer.producer, self.name)

    def __set__(self, trainer, value) -> None:
        setattr(trainer.producer, self.name, value if isinstance(value, torch.Tensor) else list(value))


def reference_scorer(ref_client, ref_model, policy, unwrapped_policy, scoring: dict):
    """Reference logps `fn(ids, mask, T) -> [b, T]`: the frozen server, the frozen copy, or (PEFT) the policy with its
    adapter disabled. `policy()` / `unwrapped_policy()` return the training model (wrapped by the Trainer after
    construction, hence callables)."""
    from .algo.logprobs import LogpsScorer

    if ref_client is not None:
        return lambda ids, mask, T: ref_client.completion_logps(ids, mask, T, scoring["temperature"])
    if ref_model is not None:
        return LogpsScorer(lambda: ref_model, **scoring)
    return LogpsScorer(policy, **scoring, context=lambda: unwrapped_policy().disable_adapter())
