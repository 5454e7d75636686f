"""`build_pipeline`: the one place the round pipeline's components are built from the config and joined.

```txt
component        file              settings it reads          receives                      calls
───────────────  ────────────────  ─────────────────────────  ────────────────────────────  ───────────────────────
engine           generation/       generation_backend,        the unwrapped policy, the     make_trainer_backend
(SharedBackend)  shared.py,        vllm_*, openai_*,          tokenizer, the model source   (the backend registry),
                 __init__.py       weight_sync_transport      (main process, first use)     once
PolicyPublisher  pipeline/         syncs_weights,             the engine (main process)     engine.load_weights /
                 publisher.py      weight_sync_inflight,                                    engine.load_adapter
                                   vllm_lora_sync
RoundProducer    pipeline/         producer_settings(): G,    engine, tokenizer, reward     engine.generate, reward
                 producer.py       sampling, lengths,         functions, names, weights,    functions, environment
                                   rewards, seed              environment, trainer columns  or rollout_func
RoundConsumer    pipeline/         consumer_settings():       collectives (sum, gather),    the old / ref log-prob
                 consumer.py       stage sizes, staleness,    old / ref log-prob scorers,   scorers
                                   importance sampling        the metric sink
RoundScheduler   pipeline/         scheduler_settings():      collectives (gather,          RoundQueue(producer),
                 scheduler.py      rounds ahead, μ, reuse     broadcast), producer,         consumer, publisher
                                   order, queue, timeout      consumer, publisher, metric
                                                              sink, steps left
```
Everything the components read from the trainer while training runs (the model, wrapped by the Trainer after
construction; its state; its metrics) goes through one [`TrainerLink`]; everything they exchange across processes
through one [`AcceleratorCollectives`] (`pipeline/collectives.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..algo.logprobs import LogpsScorer
from ..generation.shared import SharedBackend
from ..weight_sync.lora import lora_sync_mode
from .collectives import AcceleratorCollectives
from .consumer import RoundConsumer
from .producer import RoundProducer
from .publisher import PolicyPublisher
from .scheduler import RoundScheduler


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
    """Builds the generation engine on first use (main process): `(backend, temporary model folder or None)`."""

    config: Any
    link: TrainerLink
    tokenizer: Any
    model_source: str | None

    def __call__(self):
        from ..generation import make_trainer_backend

        return make_trainer_backend(self.config, self.link.unwrapped_policy(), self.tokenizer, self.model_source)


@dataclass
class Pipeline:
    """The components `build_pipeline` returns (see the module's table)."""

    engine: SharedBackend | None  # main process only
    publisher: PolicyPublisher
    producer: RoundProducer
    consumer: RoundConsumer
    scheduler: RoundScheduler
    collectives: AcceleratorCollectives


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
    scoring: dict,
    old_logps: bool,
    ref_logps,
) -> Pipeline:
    """Build the round pipeline from `config` (a `GRPOConfig`) and join its components.

    Args:
        config (`GRPOConfig`): read through `producer_settings`, `consumer_settings`, `scheduler_settings` and the
            fields of the module's table.
        link (`TrainerLink`): the trainer, read at call time.
        collectives (`AcceleratorCollectives`).
        tokenizer: the processing class.
        rewards (`tuple`): `(reward functions, reward names)` (`trainer_setup.prepare_rewards`).
        reward_weights (`torch.Tensor` `[F]`).
        environment (*optional*): a multi-turn environment.
        model_source (`str`, *optional*): what engines that load a model themselves read (the model's id or path).
        scoring (`dict`): keyword arguments of the log-prob scorers (`LogpsScorer`): temperature, padding_free,
            device, ...
        old_logps (`bool`): whether the consumer scores π_old (the policy moves before a round is trained, or the
            importance-sampling correction needs it).
        ref_logps (`LogpsFn` or `None`): the reference log-prob scorer (`trainer_setup.reference_scorer`); `None`
            when `beta == 0`.
    """
    from ..trainer_setup import consumer_settings, producer_settings, scheduler_settings

    engine = SharedBackend(EngineFactory(config, link, tokenizer, model_source)) if collectives.is_main else None
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
        producer_settings(config),
        environment=environment,
        extra_columns=link.reward_columns,
        rollout_func=link.rollout if link.rollout_func is not None else None,
    )
    consumer = RoundConsumer(
        consumer_settings(config),
        num_processes=collectives.num_processes,
        process_index=collectives.process_index,
        old_logps=LogpsScorer(link.policy, **scoring) if old_logps else None,
        ref_logps=ref_logps,
        reduce_sum=collectives.reduce_sum,
        gather=collectives.gather_tensor,
        log=link.record,
    )
    scheduler = RoundScheduler(
        scheduler_settings(config),
        collectives,
        producer,
        consumer,
        publisher=publisher,
        log=link.record,
        steps_left=link.steps_left,
    )
    return Pipeline(engine, publisher, producer, consumer, scheduler, collectives)
