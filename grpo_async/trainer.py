"""`GRPOTrainer`: a `transformers.Trainer` whose inputs are generated ahead of training by a background thread.

Trainer overrides only; each job has its own component (`grpo_async/pipeline/`), built from the config by one call,
`pipeline/build.py: build_pipeline` (its docstring tables what each component reads, receives and calls):

```txt
            every rank                                    main process, generator thread (AsyncBatchGenerator)
 round r ─▶ RoundConsumer ◀── broadcast ── Round ◀─────── RoundProducer (tokenize, generate, rewards, advantages)
   │        (slice, staleness,                              ▲ RoundRequest (rows of every rank, gathered)
   │         logps, IS, GA split)                           │
   ▼                                                        │ weights of step s, streamed from the live model
 micro-steps ─▶ optimizer.step() ─▶ PolicyPublisher ────────┘ (before the round that uses them is generated)
```

Which round is generated when, from which weights (the staleness it gets): `pipeline/scheduler.py`.
"""

from __future__ import annotations

import functools
import logging
import time

from transformers import PreTrainedModel, Trainer

from .algo.loss import LossContext
from .algo.token_budget import budgeted_loss
from .callbacks import notify_micro_batch
from .config import GRPOConfig
from .data.async_loader import AsyncDataLoaderWrapper, wrapper_skips_batches
from .data.sampler import RepeatSampler
from .interrupt import debug_enabled
from .logging_utils import MetricsJsonlCallback
from .model_card import write_model_card
from .model_config import check_context_length, needs_find_unused_parameters
from .pipeline import checkpointing as ckpt
from .pipeline.metrics import loss_metrics
from .pipeline.types import MicroBatch
from .rewards.reward_model import RewardModel
from .trainer_pipeline import TrainerPipeline
from .trainer_setup import (
    check_datasets,
    check_router_replay,
    default_args,
    experimental_warnings,
    is_iterable,
    is_peer_failure,
    peer_failure_error,
    prepare_models,
    prepare_rewards,
    train_stream,
    trainer_environment,
)
from .trl_attributes import TRLAttributes

logger = logging.getLogger(__name__)


def _identity(rows):
    return rows


class GRPOTrainer(TRLAttributes, TrainerPipeline, Trainer):
    """Group Relative Policy Optimization with asynchronous generation.

    Args:
        model (`str` or `PreTrainedModel`): a model id/path (loaded with `args.model_init_kwargs`) or a model.
        reward_funcs (`callable`, `str`, `PreTrainedModel` or a list of them, *optional*): `f(prompts, completions,
            completion_ids, **columns)` returning one float (or `None`) per completion (`grpo_async.rewards`), or, as
            in TRL, a sequence-classification reward model (id, path or model), tokenizer from
            `reward_processing_classes`. Optional when the environment brings a reward (`get_reward`).
        args (`GRPOConfig`, *optional*): configuration; a default one writing to `<model>-GRPO` if omitted.
        train_dataset (`datasets.Dataset`): rows with a `prompt` column (text or chat messages) plus any columns
            the reward functions read.
        eval_dataset (`datasets.Dataset`, *optional*): same format.
        processing_class (`PreTrainedTokenizerBase`, *optional*): loaded from the model if omitted; needs a pad token.
        callbacks, optimizers, quantization_config: as for TRL (the last one loads `model` when it is a name).
        peft_config (`peft.PeftConfig`, *optional*): train a PEFT adapter; the reference model is then the base
            model with the adapter disabled.
        tools (`list[callable]`, *optional*): TRL-style shortcut for `environment=ToolEnv(tools)`.
        rollout_func, environment_factory (*optional*): TRL's: `rollout_func(prompts, trainer)` generates
            (`grpo_async.envs.rollout.run_rollout_func`); one environment per rollout (`grpo_async.envs.factory`).
        environment (`grpo_async.envs.Environment`, *optional*): multi-turn rollouts: the model and the environment
            take turns (`grpo_async.envs`); prompts must be chat messages. Reward functions get the completion's
            messages (assistant and environment turns).
    """

    loss_is_scaled_for_ga = True  # compute_loss already divides by gradient accumulation
    _tag_names = ["trl", "grpo", "grpo_async"]

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        environment=None,
    ):
        args = default_args(model, args)
        self._model_source = model if isinstance(model, str) else None  # what engines that load a model read
        model, processing_class, ref_model = prepare_models(
            model, args, processing_class, peft_config, quantization_config
        )
        self.is_peft = peft_config is not None
        check_context_length(args, model.config)
        if args.ddp_find_unused_parameters is None:  # transformers: True without gradient checkpointing (warns)
            args.ddp_find_unused_parameters = needs_find_unused_parameters(model, args)
        train_dataset = check_datasets(train_dataset, eval_dataset, args, environment_factory)
        self.environment = trainer_environment(
            environment, tools, environment_factory, rollout_func, processing_class, args, train_dataset, eval_dataset
        )
        rollout = rollout_func is not None or type(self)._generate is not GRPOTrainer._generate
        check_router_replay(args, model, self.environment, rollout)  # MoE, a router it can drive, one sampler call
        rewards, weights = prepare_rewards(
            reward_funcs, reward_processing_classes, args, self.environment, train_dataset, adds_columns=rollout
        )
        experimental_warnings(rollout_func, environment_factory)  # TRL's, verbatim
        self.tools = list(tools or [])  # TRL's attribute: the standalone tools
        # TRL's attribute: a reward model's tokenizer, None for a function
        self.reward_processing_classes = [f.tokenizer if isinstance(f, RewardModel) else None for f in rewards[0]]
        super().__init__(
            model=model,
            args=args,
            data_collator=_identity,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.add_callback(MetricsJsonlCallback(plot=self.args.save_metrics_plot))
        self._build_pipeline(ref_model, processing_class, rewards, weights, rollout_func)  # trainer_pipeline.py

    # ---- data ----------------------------------------------------------------------------------------------------
    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def _get_train_sampler(self, dataset=None):
        dataset = self.train_dataset if dataset is None else dataset
        return RepeatSampler(
            data_source=dataset,
            mini_repeat_count=self.args.num_generations,
            batch_size=self.args.generation_batch_size // self.args.num_generations,
            repeat_count=self.args.num_iterations * self.args.steps_per_generation,
            shuffle=self.args.shuffle_dataset,
            seed=self.args.seed,
        )

    def _get_eval_sampler(self, eval_dataset):
        """TRL's eval sampler: each prompt `num_generations_eval` times in a row, prompts shuffled (seeded)."""
        G = self.num_generations_eval
        return RepeatSampler(data_source=eval_dataset, mini_repeat_count=G, seed=self.args.seed)

    def get_eval_dataloader(self, eval_dataset=None):
        """TRL's eval dataloader (`evaluate()` does not use it: it generates from the eval set itself): a streaming
        set is shuffled (seeded) and repeated `num_generations_eval` times per prompt, read by one worker for this
        loader only (`args.dataloader_num_workers` is left as it is), as TRL does."""
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
        dataset = self.eval_dataset if dataset is None else dataset
        if not is_iterable(dataset):
            return super().get_eval_dataloader(eval_dataset)
        from .data.sampler import repeat_iterable

        stream = repeat_iterable(dataset.shuffle(seed=self.args.seed), mini_repeat_count=self.num_generations_eval)
        workers, self.args.dataloader_num_workers = self.args.dataloader_num_workers, 0
        try:
            return super().get_eval_dataloader(stream)
        finally:
            self.args.dataloader_num_workers = workers

    def get_train_dataloader(self):
        """The generation-batch dataloader (per device: `per_device_train_batch_size × steps_per_generation`
        rows), wrapped so the pipeline can peek at the rounds ahead."""
        dataloader = self._get_dataloader(
            dataset=train_stream(self.train_dataset, self.args),  # a stream: reordered like the sampler would
            description="Training",
            batch_size=self._train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )
        ahead = self.args.rounds_ahead * self.rounds.generate_every
        loader = AsyncDataLoaderWrapper(
            dataloader,
            buffer_size=max(5, ahead + self.args.gradient_accumulation_steps + 1),
            history_size=self.args.gradient_accumulation_steps + 1,
        )
        self.rounds.attach(loader)
        return loader

    # ---- the pipeline --------------------------------------------------------------------------------------------
    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            raise RuntimeError("GRPOTrainer evaluates through evaluate(), which generates its own completions")
        policy = self.accelerator.unwrap_model(self.model)
        batch = self.rounds.next_micro_batch(generation_batch, self.state.global_step, policy)
        batch = batch.to(self.accelerator.device)
        notify_micro_batch(self.callback_handler, self.args, self.state, self.control, batch)  # GRPOCallback
        return batch

    def end(self) -> None:
        """Transformers' `Trainer.end` (finish the trackers, destroy the process group), after `close()`: the engine
        (an in-process vLLM holds process groups of its own) shuts down while the process group still exists.
        Safe with every backend, and before or after another `close()`."""
        self.close()
        end = getattr(super(), "end", None)  # transformers >= 5.18
        if end is not None:
            end()

    # ---- loss and step -------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs: MicroBatch, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss does not return outputs")
        part_loss = functools.partial(self._part_loss, model)  # each slice of token_budget (algo/token_budget.py)
        no_sync = lambda: self.accelerator.no_sync(model)  # noqa: E731
        return budgeted_loss(inputs, self.args.token_budget, part_loss, self.accelerator.backward, no_sync)

    def _part_loss(self, model, inputs: MicroBatch, totals: dict | None, last: bool):
        a = self.args
        ctx = LossContext(
            grad_accum_steps=self.current_gradient_accumulation_steps,
            max_completion_length=a.max_completion_length,
            num_items_in_batch=inputs.num_items_in_batch,
            num_processes=self.accelerator.num_processes,
            steps_per_generation=a.steps_per_generation,
            **(totals or {}),
        )
        out = self.objective.forward_loss(
            model,
            inputs,
            ctx,
            temperature=a.temperature,
            padding_free=a.padding_free,
            share_prefix=a.share_prompt_prefix,
            max_positions=a.token_budget,
            end_of_window=self.accelerator.sync_gradients and last,
        )
        self.throughput.add(int(inputs.prompt_mask.sum() + inputs.completion_mask.sum()), len(inputs))
        self.metric_windows.record_all(loss_metrics(out, inputs, self.state.global_step, self.collectives))
        return out.loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        start = time.perf_counter()
        self.rounds.take_wait()
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        except RuntimeError as e:
            if self.accelerator.num_processes > 1 and is_peer_failure(e):
                raise peer_failure_error(e, self.accelerator, self._step, self.state.global_step, self.args) from e
            raise
        self._step += 1
        self.metric_windows.add_call(time.perf_counter() - start, waited=self.rounds.take_wait())
        if self._step % self.current_gradient_accumulation_steps == 0:
            self.metric_windows.end_step(self.throughput)  # step_time, timing/train_step, perf/*
            self.rounds.end_step()  # logs async/overlap, async/trainer_wait, async/generator_idle of this step
        return loss

    # ---- metrics -------------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        super().log({**logs, **{prefix + k: v for k, v in self.metric_windows.pop(mode).items()}}, start_time)
        self._log_completions()  # log_completions: the last round's samples, once

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, **kwargs) -> None:
        """Writes `README.md` into `output_dir` (main process): method, base model, reward functions and weights,
        datasets, non-default config, framework versions; `push_to_hub` calls it before uploading, and (as TRL)
        every checkpoint save before saving."""
        write_model_card(self, model_name=model_name, dataset_name=dataset_name or kwargs.get("dataset"), tags=tags)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`, plus the model card (`README.md`) in the saved folder when called by the user."""
        super().save_model(output_dir, _internal_call)
        if not _internal_call:  # a checkpoint's own save: the card goes to output_dir (`_save_checkpoint`)
            write_model_card(self, output_dir=output_dir)

    # ---- evaluation ----------------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """`num_generations_eval` completions per eval prompt on the current weights (published first, after any round
        in flight, and in rounds mode generated once that round is scored: reward calls one at a time), scored
        (`pipeline/evaluation.py`); logs TRL's `<prefix>_loss`, `_reward`, `_reward_std`, `_rewards/<func>`,
        `_completions/mean_length`."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        dataset = self.eval_dataset[dataset] if isinstance(dataset, str) else dataset  # Trainer: an eval set's name
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (none was given to the trainer or to evaluate)")
        if isinstance(dataset, dict):
            out = {}
            for name, ds in dataset.items():
                out.update(self.evaluate(ds, ignore_keys, f"{metric_key_prefix}_{name}"))
            return out
        start = time.perf_counter()
        # every rank's engine, before the main process alone generates (with weight sync off nothing publishes here
        # to build them; see `RoundProducer.build_engine`)
        self.producer.build_engine()
        self._publish()
        if self.args.async_mode == "rounds":  # a publish waits for sampling only: the eval scores after the round
            self.rounds.wait_until_idle()  # (stream mode scores its groups side by side anyway)
        config = self.accelerator.unwrap_model(self.model).config
        metrics = self.evaluator(dataset, self.model, self.objective.state_dict(), config)  # pipeline/evaluation.py
        metrics["runtime"] = time.perf_counter() - start
        metrics["num_tokens"] = float(self.state.num_input_tokens_seen)  # TRL's eval_num_tokens
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        metrics["epoch"] = self.state.epoch
        Trainer.log(self, metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ---- lifecycle and checkpoints -------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`; resuming also restores the pipeline (`pipeline/checkpointing.py`): the run continues with
        exactly the prompts an uninterrupted run would have trained. The rounds in flight at the checkpoint
        (generated ahead from older weights, not yet trained) were saved whole in it (`grpo_async_rounds.safetensors`)
        and are trained as generated, so the run ends where an uninterrupted one ends; only a round whose generation
        failed is generated again, from the checkpoint's weights."""
        if resume_from_checkpoint:
            resume_from_checkpoint = ckpt.resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
            self._restore_pipeline(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except KeyboardInterrupt as e:
            raise self._interrupted() from (e if debug_enabled() else None)
        finally:
            self.rounds.stop()

    def _run_epoch(self, *args, **kwargs):
        if self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps:
            # resumed from a checkpoint at (or past) `max_steps`, mid-epoch: `Trainer` would train one more step before
            # its `max_steps` check (a finished run re-launched with `resume_from_checkpoint` trained step N + 1)
            logger.info(f"resumed at step {self.state.global_step}, max_steps={self.state.max_steps}: no step left")
            self.control.should_training_stop = True
            return
        with wrapper_skips_batches():  # resuming mid-epoch: our look-ahead wrapper skips the batches itself
            return super()._run_epoch(*args, **kwargs)
