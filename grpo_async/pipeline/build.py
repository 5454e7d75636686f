"""`build_pipeline`: the one place the round pipeline's components are built from the config and joined.

```txt
component        file              settings it reads          receives                      calls
───────────────  ────────────────  ─────────────────────────  ────────────────────────────  ───────────────────────
engine           generation/       generation_backend,        the unwrapped policy, the     make_trainer_backend
(SharedBackend)  shared.py,        vllm_*, openai_*,          tokenizer, the model source   (the backend registry),
                 __init__.py       weight_sync_transport      (first use; main process, or  once
                                                              every rank: see below)
PolicyPublisher  pipeline/         syncs_weights,             the engine (where there is    engine.load_weights /
                 publisher.py      weight_sync_inflight,      one)                          engine.load_adapter
                                   vllm_lora_sync
RoundProducer    pipeline/         Settings.from_config: G, engine, tokenizer, reward     engine.generate, reward
                 producer.py       sampling, lengths,         functions, names, weights,    functions, environment
                                   rewards, seed              environment, trainer columns  or rollout_func
RoundConsumer    pipeline/         Settings.from_config:     collectives (sum, gather),    the old / ref log-prob
                 consumer.py       stage sizes, staleness,    old / ref log-prob scorers,   scorers
                                   importance sampling        the metric sink
RoundScheduler   pipeline/         Settings.from_config:     collectives (gather,          AsyncBatchGenerator or
                 scheduler.py      rounds ahead, μ, reuse     broadcast), producer,         GroupStream (producer),
                                   order, queue, timeout      consumer, publisher, metric   consumer, publisher
                                                              sink, steps left, joiner
RoundJoiner      pipeline/         G, scale_rewards,          the producer's reward         —
(every rank      join.py           multi_objective_agg.,      weights and names
 generates)                        the pad token
LogpsScorer      pipeline/         beta, ref_server_url,      the reference copy or client, the scored model /
(π_ref, π_old)   reference.py      temperature, padding_free, the policy (PEFT: adapter     the reference server
                                   μ, importance sampling     off), the device
Evaluator        pipeline/         per_device_eval_batch_size the producer, collectives,    producer.evaluate,
                 evaluation.py     num_generations_eval       the π_ref scorer, the device  the π_ref scorer
```
Who weighs the rows by π_old / π_sampler (importance sampling) is decided here once: the training objective, with π_old
from its own forward (`InForwardImportanceSampling`, returned as `Pipeline.importance_sampling` for the trainer's
`PolicyObjective`), or the consumer after its no-grad π_old pass (`needs_old_logps`).

Everything the components read from the trainer while training runs (the model, wrapped by the Trainer after
construction; its state; its metrics) goes through one [`TrainerLink`]; everything they exchange across processes
through one [`AcceleratorCollectives`] (`pipeline/collectives.py`).

Where generation runs ([`generates_on_every_rank`]): with several processes and an engine that lives in the training
process (`hf`, in-process `vllm`), every rank builds its own engine, generates and scores its own rows of each round
(whole groups) and publishes its own model into it, as TRL does: no weights cross processes, and N engines generate
at once. The ranks' parts are joined on every rank (`pipeline/join.py`: advantages over the whole round). Servers,
the OpenAI backend, registered backends and TRL's `rollout_func` keep the main-process design: the main process
generates every row and broadcasts the round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..algo.logprobs import LogpsScorer
from ..algo.objective import InForwardImportanceSampling
from ..generation.registry import backend_spec
from ..generation.shared import SharedBackend
from ..vision_processor import vision_placeholder_ids
from ..weight_sync.lora import lora_sync_mode
from .collectives import AcceleratorCollectives
from .consumer import ConsumerSettings, RoundConsumer
from .evaluation import Evaluator, eval_chunk_prompts
from .join import JoinSettings, RoundJoiner
from .producer import ProducerSettings, RoundProducer
from .publisher import PolicyPublisher
from .reference import needs_old_logps, reference_client, reference_scorer
from .scheduler import RoundScheduler, SchedulerSettings

logger = logging.getLogger(__name__)


def generates_on_every_rank(config, num_processes: int, rollout_func=None) -> bool:
    """Whether every rank generates its own rows with its own engine: several processes, an in-process backend
    (its `BackendSpec.in_process`), no `rollout_func` (it generates for the whole round), and each process's rows of a
    round (`generation_batch_size / processes`) whole groups of `num_generations` (a group is never split across
    ranks: its G completions are generated in one call, share one prompt prefill and are scored together). When the
    rows split a group the main process generates, and the log says why."""
    if num_processes == 1 or not backend_spec(config.generation_backend).in_process or rollout_func is not None:
        return False
    local, G = config.generation_batch_size // num_processes, config.num_generations
    if local % G:
        logger.warning(
            "generation_backend=%r with %d processes: each process's %d rows of a round split groups of "
            "num_generations=%d, so the main process generates every row (an engine on every rank needs "
            "generation_batch_size / processes to be a multiple of num_generations)",
            config.generation_backend,
            num_processes,
            local,
            G,
        )
        return False
    return True


class TrainerLink:
    """What the pipeline reads from the trainer while it runs, at the moment it needs it: the policy (the Trainer
    wraps it after construction), the training state, the metric sink, and TRL's `rollout_func` with the trainer.

    Args:
        trainer (`GRPOTrainer`): reads its public `model`, `accelerator`, `state` and `record_metric`.
        rollout_func (`Callable[[list, GRPOTrainer], dict]`, *optional*): TRL's, called with the trainer.
    """

    def __init__(self, trainer, rollout_func=None):
        self.trainer = trainer
        self.rollout_func = rollout_func

    def policy(self) -> nn.Module:
        """The policy as the Trainer trains it (wrapped: DDP, DeepSpeed, ...)."""
        return self.trainer.model

    def unwrapped_policy(self) -> nn.Module:
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    def reward_columns(self) -> dict:
        """Passed to every reward call besides the dataset's columns (as TRL: reward shaping by training progress)."""
        return {"trainer_state": self.trainer.state}

    def steps_left(self) -> int:
        """Optimizer steps still to run, the one in progress included (no round is generated past `max_steps`)."""
        return self.trainer.state.max_steps - self.trainer.state.global_step

    def record(self, key: str, value: float) -> None:
        self.trainer.record_metric(key, value)

    def rollout(self, prompts: list) -> dict:
        return self.rollout_func(prompts, self.trainer)


@dataclass
class EngineFactory:
    """Builds the generation engine on first use (the main process, or every rank: `generates_on_every_rank`):
    `(backend, temporary model folder or None)`. `alone`: the main process builds the only engine of several
    processes."""

    config: Any
    link: TrainerLink
    tokenizer: Any
    model_source: str | None
    alone: bool = False

    def __call__(self):
        from ..generation import make_trainer_backend

        policy = self.link.unwrapped_policy()
        return make_trainer_backend(self.config, policy, self.tokenizer, self.model_source, alone=self.alone)


@dataclass
class Pipeline:
    """The components `build_pipeline` returns (see the module's table)."""

    engine: SharedBackend | None  # where generation runs: the main process, or every rank (`per_rank`)
    publisher: PolicyPublisher
    producer: RoundProducer
    consumer: RoundConsumer
    scheduler: RoundScheduler
    evaluator: Evaluator  # `Trainer.evaluate`: generates and scores the eval set with the same producer
    collectives: AcceleratorCollectives
    ref_client: Any = None  # the reference server's client (`ref_server_url`), else None
    per_rank: bool = False  # every rank generates its own rows (`generates_on_every_rank`)
    #: π_old from the training forward: the training objective weighs the rows, the consumer does not
    importance_sampling: InForwardImportanceSampling | None = None


def build_pipeline(
    config,
    link: TrainerLink,
    collectives: AcceleratorCollectives,
    *,
    tokenizer,
    rewards: tuple,
    reward_weights: torch.Tensor,
    environment=None,
    model_source: str | None = None,
    ref_model: nn.Module | None = None,
    device=None,
) -> Pipeline:
    """Build the round pipeline from `config` (a `GRPOConfig`) and join its components.

    Args:
        config (`GRPOConfig`): read through the settings' `from_config` (producer, consumer, scheduler) and the
            fields of the module's table.
        link (`TrainerLink`): the trainer, read at call time.
        collectives (`AcceleratorCollectives`).
        tokenizer: the processing class.
        rewards (`tuple`): `(reward functions, reward names)` (`trainer_setup.prepare_rewards`).
        reward_weights (`torch.Tensor` `[F]`).
        environment (*optional*): a multi-turn environment.
        model_source (`str`, *optional*): what engines that load a model themselves read (the model's id or path).
        ref_model (`nn.Module`, *optional*): the frozen reference copy, prepared by the accelerator (`beta > 0`
            without PEFT or a reference server; `pipeline/reference.py`).
        device: where the log-prob scorers and the evaluation run (the accelerator's device).
    """
    scoring = {  # the log-prob scorers' (`LogpsScorer`) settings: π_old, π_ref, evaluation
        "temperature": config.temperature,
        "padding_free": config.padding_free,
        "device": device,
        "share_prefix": config.share_prompt_prefix,  # algo/prefix_sharing.py
        "max_positions": config.token_budget,  # a packed pass's positions, filler included (algo/packing.py)
    }
    ref_client = reference_client(config)
    ref_logps = reference_scorer(ref_client, ref_model, link, scoring) if config.beta else None
    per_rank = generates_on_every_rank(config, collectives.num_processes, link.rollout_func)
    has_engine = per_rank or collectives.is_main
    alone = not per_rank and collectives.num_processes > 1
    text = getattr(tokenizer, "tokenizer", tokenizer)  # a VLM's processor: the engine and pads use its tokenizer
    engine = SharedBackend(EngineFactory(config, link, text, model_source, alone)) if has_engine else None
    publisher = PolicyPublisher(
        engine,
        enabled=config.syncs_weights,
        inflight=config.weight_sync_inflight,
        adapter=lora_sync_mode(config, link.unwrapped_policy()) == "adapter",  # PEFT LoRA: the adapter only
    )
    producer = RoundProducer(
        engine,
        tokenizer,
        *rewards,
        reward_weights,
        ProducerSettings.from_config(config),
        environment=environment,
        extra_columns=link.reward_columns,
        rollout_func=link.rollout if link.rollout_func is not None else None,
    )
    never_sampled = tuple(vision_placeholder_ids(getattr(link.unwrapped_policy(), "config", None)))
    # who weighs the rows by π_old / π_sampler, decided here only: the training objective (π_old = its own forward's
    # log-probs) or the consumer, after a no-grad π_old pass over the round
    in_forward = InForwardImportanceSampling.from_config(config, never_sampled)
    old_logps = needs_old_logps(config, in_forward is not None)
    consumer = RoundConsumer(
        # a VLM's image placeholders: every backend's bad words
        ConsumerSettings.from_config(config, never_sampled, in_forward=in_forward is not None),
        collectives=collectives,
        old_logps=LogpsScorer(link.policy, **scoring).scores if old_logps else None,
        ref_logps=ref_logps,
        log=link.record,
    )
    joiner = None
    if per_rank or config.async_mode == "stream":  # stream mode joins prompt groups into rounds the same way
        ps = ProducerSettings.from_config(config)
        joiner = RoundJoiner(
            JoinSettings(ps.num_generations, ps.scale_rewards, ps.multi_objective_aggregation, text.pad_token_id),
            reward_weights=lambda: producer.reward_weights,
            reward_names=lambda: producer.reward_names,
        )
    scheduler = RoundScheduler(
        SchedulerSettings.from_config(config),
        collectives,
        producer,
        consumer,
        publisher=publisher,
        log=link.record,
        steps_left=link.steps_left,
        join=joiner if per_rank else None,
        assemble=joiner if config.async_mode == "stream" else None,
    )
    evaluator = Evaluator(config, producer, collectives, ref_logps, device, eval_chunk_prompts(config))
    return Pipeline(
        engine, publisher, producer, consumer, scheduler, evaluator, collectives, ref_client, per_rank, in_forward
    )
