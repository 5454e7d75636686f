"""Construction-time checks and process-group helpers of `GRPOTrainer` (no Trainer reference here)."""

from __future__ import annotations

import copy
import logging
import warnings
from typing import TYPE_CHECKING

import torch

from .pipeline.producer import is_conversational

logger = logging.getLogger(__name__)

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


def experimental_warnings(rollout_func, environment_factory) -> None:
    """TRL 1.16's warnings (verbatim) for its experimental `rollout_func` and `environment_factory`; silenced, as in
    TRL, by the environment variable `TRL_EXPERIMENTAL_SILENCE=1`."""
    import os

    if os.environ.get("TRL_EXPERIMENTAL_SILENCE", "0") == "1":
        return
    for name, given in (("rollout_func", rollout_func), ("environment_factory", environment_factory)):
        if given is not None:
            warnings.warn(
                f"You are using '{name}', which is an experimental feature. This API may change or be removed at "
                "any time without prior notice. Silence this warning by setting environment variable "
                "TRL_EXPERIMENTAL_SILENCE=1.",
                UserWarning,
                stacklevel=3,
            )


def reward_weights_tensor(weights: list[float] | None, num_funcs: int) -> torch.Tensor:
    """`[F]` weights of the reward functions (all 1 when not given)."""
    if weights is not None and len(weights) != num_funcs:
        raise ValueError(f"GRPOConfig.reward_weights has {len(weights)} values for {num_funcs} reward functions")
    return torch.tensor(weights or [1.0] * num_funcs, dtype=torch.float32)


def is_iterable(dataset) -> bool:
    """A streaming dataset (`datasets.IterableDataset`, or any torch `IterableDataset`): no `len()`, no indexing."""
    from torch.utils.data import IterableDataset

    return isinstance(dataset, IterableDataset)


def check_dataset(
    dataset, args: GRPOConfig, name: str, min_rows: int | None = None, prompt_optional: bool = False
) -> None:
    """The earliest checks of a train/eval set: a 'prompt' column, enough prompts for one round; a streaming train set
    needs `max_steps` (its length is unknown), `dispatch_batches=False` (each process reads its own slice of the
    stream, as TRL) and one dataloader worker (several would interleave the stream and split the G copies)."""
    if isinstance(dataset, dict):  # several eval sets by name (a dict or a `datasets.DatasetDict`, as TRL takes)
        for key, ds in dataset.items():
            check_dataset(ds, args, f"{name}[{key!r}]", min_rows, prompt_optional)
        return
    if is_iterable(dataset):
        columns = getattr(dataset, "column_names", None)  # None when the stream's features are unknown
        if columns is not None and "prompt" not in columns and not prompt_optional:
            raise ValueError(f"{name} needs a 'prompt' column (text or chat messages); it has {columns}")
        if name == "train_dataset" and args.max_steps <= 0:
            raise ValueError(
                "train_dataset is an IterableDataset (a stream of unknown length): set GRPOConfig.max_steps to a "
                "positive number of optimizer steps"
            )
        if args.accelerator_config.dispatch_batches:  # TRL's text, then which set
            raise ValueError(
                "Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                f"`accelerator_config`. Please set it to `False`. ({name} is an IterableDataset: each process reads "
                "its own slice of the stream)"
            )
        args.accelerator_config.dispatch_batches = False
        if name == "train_dataset" and args.dataloader_num_workers != 0:  # TRL's text (several would interleave the
            warnings.warn(  # stream and split each prompt's num_generations copies)
                "Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding the "
                f"provided value ({args.dataloader_num_workers}).",
                stacklevel=3,
            )
            args.dataloader_num_workers = 0
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None and len(dataset):
        columns = list(dataset[0].keys())
    if columns is not None and "prompt" not in columns and not prompt_optional:  # optional: environment_factory
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


def check_datasets(train_dataset, eval_dataset, args: GRPOConfig, environment_factory=None):
    """`check_dataset` on both sets; without a train set but with an `environment_factory`, TRL's placeholder: one
    round of empty user prompts (the environment's `reset` writes the prompt), cycled for `max_steps`. Returns the
    train set. Without either, TRL's error (a trainer is for training; `evaluate` alone needs a train set too, as in
    TRL)."""
    if train_dataset is None and environment_factory is None:
        raise ValueError("`train_dataset` is required unless an `environment_factory` is provided.")
    if train_dataset is None:
        if isinstance(environment_factory, dict):
            raise ValueError(
                "A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                "`environment` column to route each example to its environment. Provide a dataset, or pass a "
                "single environment factory."
            )
        if args.max_steps <= 0:
            raise ValueError(
                "When training without a `train_dataset` (the environment owns the data and returns the prompt "
                "from `reset()`), `max_steps` must be set to a positive value to define the training length. Set "
                "it via `GRPOConfig(max_steps=...)`."
            )
        from datasets import Dataset

        rows = args.generation_batch_size // args.num_generations
        train_dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * rows})
    optional = environment_factory is not None  # TRL: the environment's reset() writes a missing prompt
    if train_dataset is not None:
        check_dataset(train_dataset, args, "train_dataset", prompt_optional=optional)
    if eval_dataset is not None:
        check_dataset(eval_dataset, args, "eval_dataset", min_rows=1, prompt_optional=optional)
    return train_dataset


def _all_datasets(datasets) -> list:
    return [d for ds in datasets if ds is not None for d in (ds.values() if isinstance(ds, dict) else [ds])]


def make_environment(
    environment, tools, *datasets, environment_factory=None, rollout_func=None, processing_class=None, args=None
):
    """The trainer's one environment: `environment=`, TRL's `tools=` (a `TRLToolEnv`), or TRL's `environment_factory`
    (a `FactoryEnvironment`, with `tools=` as extra tools; `args.max_tool_calling_iterations` bounds its turns).
    Checks the datasets' prompts are conversational (and, for a dict of factories, their `environment` column)."""
    from .envs import FactoryEnvironment, TRLToolEnv, check_environment

    given = [k for k, v in (("environment", environment), ("environment_factory", environment_factory)) if v]
    if len(given) > 1:
        raise ValueError("give either environment= or environment_factory=, not both")
    if rollout_func is not None and (given or tools):
        raise ValueError(
            "rollout_func generates the completions itself: it cannot be combined with environment=, "
            "environment_factory= or tools= here (run the environment or the tools inside the rollout function)"
        )
    if environment_factory is not None:
        iterations = getattr(args, "max_tool_calling_iterations", None)
        environment = FactoryEnvironment(
            environment_factory,
            tools=tools,
            tokenizer=processing_class,
            max_turns=None if iterations is None else iterations + 1,
        )
        tools = None
    if tools is not None:
        if environment is not None:
            raise ValueError("give either environment= or tools= (tools=[...] is environment=TRLToolEnv([...]))")
        iterations = getattr(args, "max_tool_calling_iterations", None)
        # TRL: at most max_tool_calling_iterations tool calls, None = until max_completion_length (every assistant
        # turn samples at least one token, so max_completion_length turns is no bound at all)
        turns = iterations + 1 if iterations is not None else getattr(args, "max_completion_length", None) or 4
        environment = TRLToolEnv(tools, max_turns=turns, tokenizer=processing_class)  # TRL's tool loop
    if environment is None:
        return None
    check_environment(environment)
    for ds in _all_datasets(datasets):  # eval sets by name too
        first = next(iter(ds), None) if is_iterable(ds) else (ds[0] if len(ds) else None)
        if first is not None and "prompt" in first and not is_conversational(first["prompt"]):
            raise ValueError(
                "a multi-turn environment needs conversational prompts (lists of chat messages); the dataset's "
                f"first prompt is {first['prompt']!r:.100}"
            )
        if isinstance(environment, FactoryEnvironment) and environment.multi and hasattr(ds, "unique"):
            names = ds.unique("environment") if "environment" in ds.column_names else [None]
            for name in names:
                environment.environment_name({"environment": name})  # TRL's error for a name it does not know
    return environment


def trainer_environment(
    environment, tools, environment_factory, rollout_func, processing_class, args, train_dataset, eval_dataset
):
    """`make_environment` with the trainer's arguments."""
    return make_environment(
        environment,
        tools,
        train_dataset,
        eval_dataset,
        environment_factory=environment_factory,
        rollout_func=rollout_func,
        processing_class=processing_class,
        args=args,
    )


def prepare_rewards(
    reward_funcs, reward_processing_classes, args: GRPOConfig, environment, train_dataset=None, adds_columns=False
):
    """The reward functions, their names and weights: the trainer's (`prepare_reward_funcs`, `args.reward_weights`),
    then the environment's own (`environment.reward_funcs`: `get_reward` of an `environment_factory` environment),
    weight 1 each, named after the function (the environment class), as in TRL. At least one reward source is
    required, as TRL requires. Each function's signature is checked against the keywords a round will pass
    (`rewards.check_reward_signatures`: TRL's, and `train_dataset`'s columns), so a wrong one fails here, not a
    round into `train()`. Returns `((funcs, names), weights)`."""
    from .rewards import check_reward_signatures, prepare_reward_funcs

    rewards = prepare_reward_funcs(reward_funcs, reward_processing_classes, args.model_init_kwargs, args.device)
    columns = getattr(train_dataset, "column_names", None)
    # an environment or a rollout function (`adds_columns`) adds columns known only when it runs; a stream may have no
    # schema: only the required parameters are checked then
    open_ended = environment is not None or adds_columns or columns is None
    check_reward_signatures(rewards[0], rewards[1], columns or [], open_ended)
    weights = reward_weights_tensor(args.reward_weights, len(rewards[0]))
    funcs, names = list(rewards[0]), list(rewards[1])
    extra = list(getattr(environment, "reward_funcs", None) or [])
    for f in extra:
        name = getattr(f, "__name__", type(f).__name__)
        names.append(name if name not in names else f"{name}_{len(names)}")
        funcs.append(f)
    if not funcs:
        raise ValueError(
            "No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose environment "
            "defines a `get_reward` method."
        )
    return (funcs, names), torch.cat([weights, torch.ones(len(extra))])


def prepare_models(model, args: GRPOConfig, processing_class, peft_config, quantization_config=None):
    """Load what was named (`quantization_config` joins `model_init_kwargs` there, as in TRL; ignored with a warning
    for a model object), check the tokenizer, build the reference (a frozen copy; none with PEFT, whose base
    model with the adapter disabled is the reference, or with a reference server), wrap PEFT, drop dropout, prove
    packed rows stay isolated, and refuse a model the in-process vLLM engine cannot serve.

    Returns `(model, processing_class, ref_model or None)`.
    """
    from .loading import load_model, load_processing_class
    from .vlm_setup import check_vision_model

    if args.sync_ref_model and peft_config is not None:  # TRL 1.16 refuses it the same way
        raise NotImplementedError(
            "GRPOConfig.sync_ref_model=True with a peft_config is not supported (as in TRL): with PEFT the reference "
            "is the base model with the adapter disabled, so there is no separate reference model to synchronise; "
            "set sync_ref_model=False, or train without PEFT"
        )
    model_id = model if isinstance(model, str) else model.config._name_or_path
    if isinstance(model, str):
        kwargs = dict(args.model_init_kwargs or {})
        if quantization_config is not None:
            if "quantization_config" in kwargs:
                raise ValueError(
                    "You set `quantization_config` both as a trainer argument and in `args.model_init_kwargs`. "
                    "Please set it in only one place, preferably as a trainer argument."
                )
            kwargs["quantization_config"] = quantization_config
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        model = load_model(model, **kwargs)
    else:
        if args.model_init_kwargs is not None:  # TRL 1.16 ignores them with this warning (verbatim)
            warnings.warn(
                "You passed `model_init_kwargs` to the `GRPOConfig`, but your model is already instantiated. The "
                "`model_init_kwargs` will be ignored.",
                stacklevel=3,
            )
        if quantization_config is not None:
            warnings.warn(
                "You passed `quantization_config` to the trainer, but your model is already instantiated. The "
                "`quantization_config` will be ignored.",
                stacklevel=3,
            )
    if processing_class is None:
        processing_class = load_processing_class(model_id, trust_remote_code=args.trust_remote_code)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a VLM's processor holds its tokenizer
    if getattr(tokenizer, "pad_token", None) is None:
        if getattr(tokenizer, "eos_token", None) is None:
            raise ValueError(
                f"The tokenizer of {model_id!r} has neither a pad token nor an EOS token to pad with. Set "
                "`tokenizer.pad_token` before creating the trainer."
            )
        tokenizer.pad_token = tokenizer.eos_token  # TRL's fallback
        logger.info("the tokenizer of %r has no pad token: padding with its EOS token, as TRL does", model_id)
    tokenizer.padding_side = "left"
    check_vision_model(args, model)  # vlm_setup.py: what a vision-language model refuses or turns off

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
    if args.cast_lm_head_to_fp32:
        for m in (model, ref_model):
            if m is not None:
                cast_lm_head_to_fp32(m)
    if args.disable_dropout:
        for m in list(model.modules()) + (list(ref_model.modules()) if ref_model is not None else []):
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    # packed rows must not attend to each other: prove it on this model once (not under ZeRO-3, whose parameters
    # are partitioned from `from_pretrained` on: a forward needs the DeepSpeed engine, and gathering them whole
    # on every rank would defeat ZeRO-3)
    if args.padding_free is not False:
        args.padding_free = packing_isolates(model, args.padding_free)

    if args.generation_backend == "vllm":  # the in-process engine starts later: refuse what it cannot serve now
        from .generation.vllm_common import check_vllm_can_serve

        check_vllm_can_serve(model.config, "GRPOConfig.generation_backend='vllm'")
    return model, processing_class, ref_model


def cast_lm_head_to_fp32(model) -> None:
    """TRL's `cast_lm_head_to_fp32`: the LM head's weights and its matmul in float32 (logits in float32 for a bf16 or
    fp16 model); with tied embeddings the embedding output keeps the model's dtype. An adapter on the head is
    refused, as in TRL."""
    import torch.nn.functional as F

    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError("GRPOConfig.cast_lm_head_to_fp32: this model has no output embedding (LM head) to cast")
    if hasattr(head, "base_layer"):
        raise ValueError(
            "GRPOConfig.cast_lm_head_to_fp32=True is not supported when the LM head carries a PEFT adapter; remove "
            "lm_head from the adapter's target modules or set cast_lm_head_to_fp32=False"
        )
    dtype = head.weight.dtype
    head.float()
    head.forward = lambda hidden: F.linear(
        hidden.float(), head.weight.float(), None if head.bias is None else head.bias
    )
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        model.get_input_embeddings().register_forward_hook(lambda module, args, output: output.to(dtype))


def check_router_replay(args: GRPOConfig, model, environment, rollout: bool) -> None:
    """Refuse `GRPOConfig.router_replay` where it cannot work (the backend's side is the config's rule and the
    backend's own check): a dense model, a MoE router `algo.router_replay` cannot drive, and completions that do not
    come from one sampler call (an environment's turns, a `rollout_func` or `_generate` override)."""
    if args.router_replay == "off":
        return
    from .algo.router_replay import ROUTERS, moe_layout

    head = f"GRPOConfig.router_replay={args.router_replay!r}"
    try:
        layout = moe_layout(model)
    except ValueError as e:
        raise ValueError(f"{head}: {e}") from None
    if layout is None:
        raise ValueError(
            f"{head}: {type(model).__name__} has no mixture-of-experts router this trainer can replay (one of "
            f"{sorted(ROUTERS)}): nothing to record; set router_replay='off'"
        )
    if environment is not None or rollout:
        what = "an environment's turns" if environment is not None else "a rollout_func (or _generate override)"
        raise ValueError(
            f"{head}: the completions come from {what}, not from one call of the generation backend, whose "
            "recorded experts they would not carry; set router_replay='off'"
        )


def packing_isolates(model, padding_free: bool | None) -> bool:
    """Whether the training passes run packed (`GRPOConfig.padding_free`): True when the model's attention isolates
    packed rows (checked once on this model); otherwise an error if the user asked for packing, padded with a warning
    for the default (None). Under DeepSpeed ZeRO-3 the check cannot run (the parameters are partitioned from
    `from_pretrained` on) and the user's choice, or packing, stands."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    from .algo.packing import check_isolation

    if is_deepspeed_zero3_enabled():
        return True
    was_training = model.training
    try:
        check_isolation(model.eval())
        return True
    except ValueError as e:
        if padding_free:
            raise
        logger.warning("%s Falling back to padded forward passes (GRPOConfig.padding_free=None, the default).", e)
        return False
    finally:
        model.train(was_training)


class ProducerAttribute:
    """A trainer attribute (TRL's name: `reward_funcs`, ...) that reads and writes `trainer.producer.<name>`."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, trainer, owner=None):
        return self if trainer is None else getattr(trainer.producer, self.name)

    def __set__(self, trainer, value) -> None:
        setattr(trainer.producer, self.name, value if isinstance(value, torch.Tensor) else list(value))
