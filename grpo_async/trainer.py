"""`GRPOTrainer`: a `transformers.Trainer` whose inputs are generated ahead of training by a background thread.

Trainer overrides and wiring only; each job has its own component (`grpo_async/pipeline/`):

```txt
            every rank                                    main process, job-queue thread
 round r ─▶ RoundConsumer ◀── broadcast ── Round ◀─────── RoundProducer (tokenize, generate, rewards, advantages)
   │        (slice, staleness,                              ▲ RoundRequest (rows of every rank, gathered)
   │         logps, IS, GA split)                           │
   ▼                                                        │ weights of step s, streamed from the live model
 micro-steps ─▶ optimizer.step() ─▶ PolicyPublisher ────────┘ (before the round that uses them is generated)
```

Timeline with `num_batches_ahead = 1` (one round = steps_per_generation × μ micro-steps):

```txt
trainer  | publish v0, submit r0, r1 | wait r0 | train r0 ......... | publish v1, submit r2 | train r1 .........
job queue|                           | gen r0 (v0) | gen r1 (v0)    |                       | gen r2 (v1) ...
```
Round r + k is generated from the weights the trainer had when round r started (staleness ≤ k rounds).
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict

import torch
from accelerate.utils import broadcast_object_list, gather_object
from transformers import PreTrainedModel, Trainer

from .algo.logprobs import completion_logps
from .algo.loss import LossContext, grpo_loss
from .config import GRPOConfig
from .data.async_loader import AsyncDataLoaderWrapper
from .data.sampler import RepeatSampler
from .generation.ref_client import RefLogpsClient
from .generation.shared import SharedBackend
from .logging_utils import MetricsJsonlCallback, log_completions
from .model_card import write_model_card
from .pipeline import checkpointing as ckpt
from .pipeline.aggregation import reuse_order
from .pipeline.consumer import RoundConsumer
from .pipeline.job_queue import AsyncBatchGenerator, BatchRequest
from .pipeline.metrics import window_summary
from .pipeline.producer import RoundProducer
from .pipeline.publisher import PolicyPublisher
from .pipeline.types import MicroBatch, Round, RoundRequest
from .rewards import prepare_reward_funcs
from .trainer_setup import (
    bound_collectives,
    check_dataset,
    consumer_settings,
    is_peer_failure,
    make_environment,
    peer_failure_error,
    prepare_models,
    producer_settings,
)

logger = logging.getLogger(__name__)


def _identity(rows):
    return rows


class GRPOTrainer(Trainer):
    """Group Relative Policy Optimization with asynchronous generation.

    Args:
        model (`str` or `PreTrainedModel`): a model id/path (loaded with `args.model_init_kwargs`) or a model.
        reward_funcs (`callable` or `list[callable]`): `f(prompts, completions, completion_ids, **columns)`
            returning one float (or `None`) per completion; see `grpo_async.rewards`.
        args (`GRPOConfig`, *optional*): configuration; a default one writing to `<model>-GRPO` if omitted.
        train_dataset (`datasets.Dataset`): rows with a `prompt` column (text or chat messages) plus any columns
            the reward functions read.
        eval_dataset (`datasets.Dataset`, *optional*): same format.
        processing_class (`PreTrainedTokenizerBase`, *optional*): loaded from the model if omitted; must have a
            pad token.
        callbacks, optimizers: as for `Trainer`.
        peft_config (`peft.PeftConfig`, *optional*): train a PEFT adapter; the reference model is then the base
            model with the adapter disabled.
        environment (`grpo_async.envs.Environment`, *optional*): multi-turn rollouts: the model and the environment
            take turns (`grpo_async.envs`); prompts must be chat messages. Reward functions get the completion's
            messages (assistant and environment turns).
        tools (`list[callable]`, *optional*): TRL-style shortcut for `environment=ToolEnv(tools)`.
    """

    loss_is_scaled_for_ga = True  # compute_loss already divides by gradient accumulation
    _saving_into_staging = False  # True while Trainer._save_checkpoint writes into the staging folder
    _tag_names = ["trl", "grpo", "grpo_async"]

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        environment=None,
        tools=None,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GRPOConfig(output_dir=f"{str(name).split('/')[-1]}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a grpo_async.GRPOConfig, got {type(args).__name__}")
        self._model_source = model if isinstance(model, str) else None  # what engines that load a model read
        model, processing_class, ref_model = prepare_models(model, args, processing_class, peft_config)
        self.is_peft = peft_config is not None
        if train_dataset is not None:
            check_dataset(train_dataset, args, "train_dataset")
        if eval_dataset is not None:
            check_dataset(eval_dataset, args, "eval_dataset", min_rows=1)
        funcs, names = prepare_reward_funcs(reward_funcs)
        weights = args.reward_weights
        if weights is not None and len(weights) != len(funcs):
            raise ValueError(f"GRPOConfig.reward_weights has {len(weights)} values for {len(funcs)} reward functions")
        weights = torch.tensor(weights or [1.0] * len(funcs), dtype=torch.float32)
        self.environment = make_environment(environment, tools, train_dataset, eval_dataset)

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
        self.add_callback(MetricsJsonlCallback())
        bound_collectives(self.accelerator.num_processes, args.ddp_timeout)
        self.ref_model = None
        if ref_model is not None:
            self.ref_model = self.accelerator.prepare_model(ref_model, evaluation_mode=True)
        self.ref_client = None
        if args.beta > 0 and args.ref_server_url is not None:
            self.ref_client = RefLogpsClient(
                args.ref_server_url, args.ref_server_api_key or args.vllm_api_key, args.vllm_server_timeout
            )

        a = args
        self.num_generations = a.num_generations
        self.generate_every = a.steps_per_generation * a.num_iterations  # micro-steps per round
        # micro-batch index trained at each micro-step of a round: a b | a b ("epoch") or a a b b ("consecutive")
        self._reuse_order = reuse_order(list(range(a.steps_per_generation)), a.num_iterations, a.reuse_order)
        self.compute_old_logps = (
            a.num_iterations > 1
            or a.steps_per_generation > a.gradient_accumulation_steps
            or a.importance_sampling_correction  # π_old of the IS ratio π_old / π_sampler
        )
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._step = 0  # training_step calls
        self._epoch_seen = None
        self._epoch_call = 0  # _prepare_inputs calls in the current epoch
        self._round = 0  # index of the next round to train (global, across epochs)
        self._submitted: set[int] = set()  # round ids submitted (tracked on every rank)
        self._buffered_inputs: list[MicroBatch] | None = None
        self._train_step_time = 0.0
        self._wait_in_step = 0.0  # part of the current training_step spent waiting for a round
        self._async_loader: AsyncDataLoaderWrapper | None = None
        self._last_samples: dict | None = None
        self._sampler_model_dir: str | None = None
        main = self.accelerator.is_main_process
        self.sampler = SharedBackend(self._make_backend) if main else None
        self.generator: AsyncBatchGenerator | None = None
        self.publisher = PolicyPublisher(
            self.sampler,
            enabled=a.syncs_weights,
            wait_idle=lambda: self.generator.wait_until_idle() if self.generator is not None else None,
            inflight=a.weight_sync_inflight,
        )
        self.producer = RoundProducer(
            self.sampler,
            processing_class,
            funcs,
            names,
            weights,
            producer_settings(a),
            environment=self.environment,
            extra_columns=lambda: {"trainer_state": self.state},  # as TRL: reward shaping by training progress
        )
        dev = self.accelerator.device
        self.consumer = RoundConsumer(
            consumer_settings(a),
            num_processes=self.accelerator.num_processes,
            process_index=self.accelerator.process_index,
            old_logps=self._policy_logps if self.compute_old_logps else None,
            ref_logps=self._ref_logps if a.beta > 0 else None,
            reduce_sum=lambda t: self.accelerator.reduce(t.to(dev), reduction="sum").cpu(),
            gather=lambda t: self.accelerator.gather(t.to(dev)).cpu(),
            log=lambda k, v: self._metrics["train"][k].append(v),
        )

    # the reward functions belong to the round producer; these read and replace them there (as TRL's attributes)
    @property
    def reward_funcs(self) -> list:
        return self.producer.reward_funcs

    @reward_funcs.setter
    def reward_funcs(self, funcs) -> None:
        self.producer.reward_funcs = list(funcs)

    @property
    def reward_func_names(self) -> list[str]:
        return self.producer.reward_names

    @reward_func_names.setter
    def reward_func_names(self, names) -> None:
        self.producer.reward_names = list(names)

    @property
    def reward_weights(self) -> torch.Tensor:
        return self.producer.reward_weights

    @reward_weights.setter
    def reward_weights(self, weights: torch.Tensor) -> None:
        self.producer.reward_weights = weights

    # ------------------------------------------------------------------------------------------------------
    # data
    # ------------------------------------------------------------------------------------------------------
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

    def get_train_dataloader(self):
        """The generation-batch dataloader (per device: `per_device_train_batch_size × steps_per_generation`
        rows), wrapped so the pipeline can peek at the rounds ahead."""
        dataloader = self._get_dataloader(
            dataset=self.train_dataset,
            description="Training",
            batch_size=self._train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )
        ahead = self.args.num_batches_ahead * self.generate_every
        self._async_loader = AsyncDataLoaderWrapper(
            dataloader,
            buffer_size=max(5, ahead + self.args.gradient_accumulation_steps + 1),
            history_size=self.args.gradient_accumulation_steps + 1,
        )
        return self._async_loader

    # ------------------------------------------------------------------------------------------------------
    # the pipeline
    # ------------------------------------------------------------------------------------------------------
    def _make_backend(self):
        """Build the generation backend (main process, on first use)."""
        from .generation import make_trainer_backend

        backend, self._sampler_model_dir = make_trainer_backend(
            self.args, self.accelerator.unwrap_model(self.model), self.processing_class, self._model_source
        )
        return backend

    def _publish(self) -> None:
        seconds = self.publisher.publish(self.accelerator.unwrap_model(self.model), self.state.global_step)
        if seconds:
            self._metrics["train"]["timing/weight_sync"].append(seconds)

    def _submit_rounds(self, generation_batch: list[dict]) -> None:
        """Submit the current round if needed and up to `num_batches_ahead` rounds after it (every rank)."""
        todo = [] if self._round in self._submitted else [(self._round, generation_batch)]
        for j in range(1, self.args.num_batches_ahead + 1):
            if self._round + j in self._submitted:
                continue
            future = self._async_loader.batch_at(self._epoch_call + j * self.generate_every)
            if future is None:  # end of the epoch: that round is generated when its epoch starts
                break
            todo.append((self._round + j, future))
        for round_id, rows in todo:
            all_rows = gather_object(list(rows))  # every rank's rows, rank order
            self._submitted.add(round_id)
            if self.accelerator.is_main_process:
                self.generator.submit_batch(BatchRequest(round_id, [], inputs=[RoundRequest(round_id, all_rows)]))

    def _fetch_round(self) -> Round:
        """The current round, from the job queue (main) to every rank; an error on main reaches every rank."""
        rnd, err = None, None
        start = time.perf_counter()
        if self.accelerator.is_main_process:
            try:
                result = self.generator.get_batch(self._round)
                rnd = result.processed_results
                rnd.generation_time = result.generation_time
            except Exception as e:  # tell the other ranks before raising, so they don't wait in the broadcast
                err, rnd = e, f"{type(e).__name__}: {e}"
        wait = time.perf_counter() - start
        self._wait_in_step += wait
        rnd = broadcast_object_list([rnd], from_process=0)[0]
        if err is not None:
            raise err
        if isinstance(rnd, str):
            raise RuntimeError(f"Async generation failed on the main process: {rnd}")
        self._log_round(rnd, wait)
        return rnd

    def _next_round(self, generation_batch: list[dict]) -> list[MicroBatch]:
        if self.accelerator.is_main_process and self.generator is None:
            self.generator = AsyncBatchGenerator(
                lambda request: self.producer(request.inputs[0]),
                max_queue_size=self.args.async_max_queue_size,
                generation_timeout=self.args.async_generation_timeout,
            ).start()
        rnd = self._fetch_round() if self._round in self._submitted else None
        self._publish()  # the weights of this step, for the rounds submitted next
        self._submit_rounds(generation_batch)
        if rnd is None:
            rnd = self._fetch_round()
        self._submitted.discard(self._round)
        self._round += 1
        return self.consumer(rnd, self.state.global_step)

    @torch.no_grad()
    def _policy_logps(self, ids: torch.Tensor, mask: torch.Tensor, T: int) -> torch.Tensor:
        a, dev = self.args, self.accelerator.device
        logps = completion_logps(self.model, ids.to(dev), mask.to(dev), T, a.temperature, padding_free=a.padding_free)
        return logps.cpu()  # [b, T]

    @torch.no_grad()
    def _ref_logps(self, ids: torch.Tensor, mask: torch.Tensor, T: int) -> torch.Tensor:
        a, dev = self.args, self.accelerator.device
        if self.ref_client is not None:  # the frozen reference server
            return self.ref_client.completion_logps(ids, mask, T, a.temperature)  # [b, T]
        ids, mask = ids.to(dev), mask.to(dev)
        if self.ref_model is not None:
            return completion_logps(self.ref_model, ids, mask, T, a.temperature, padding_free=a.padding_free).cpu()
        with self.accelerator.unwrap_model(self.model).disable_adapter():  # PEFT: the base model is the reference
            return completion_logps(self.model, ids, mask, T, a.temperature, padding_free=a.padding_free).cpu()

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            raise RuntimeError("GRPOTrainer evaluates through evaluate(), which generates its own completions")
        loader = self._async_loader
        if loader is not None and loader.epoch != self._epoch_seen:  # a new epoch (resumed: started `skipped` in)
            self._epoch_seen, self._epoch_call = loader.epoch, loader.skipped
        if self._epoch_call % self.generate_every == 0 or self._buffered_inputs is None:
            self._buffered_inputs = self._next_round(generation_batch)
        inputs = self._buffered_inputs[self._reuse_order[self._epoch_call % self.generate_every]]
        self._epoch_call += 1
        return inputs.to(self.accelerator.device)

    def sync_weights(self) -> None:
        """Publish the trainer's current weights to the sampler now (every rank must call), e.g. to inspect the
        sampler between `train()` calls. Training publishes by itself at each round boundary."""
        self.publisher.reset()
        self._publish()

    @property
    def backend(self):
        """The generation backend (main process; `None` until first used)."""
        return self.sampler.built if self.sampler is not None else None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the job-queue thread and shut the generation backend down (an in-process vLLM engine frees its
        memory); `train()` can run again (a new backend is built then). A thread still stuck after `timeout` seconds
        (e.g. pushing to a dead server) is a daemon: the backend is then left to the process's exit."""
        generator = self.generator
        self.close_generator(timeout)
        if self.sampler is not None:
            if generator is not None and generator.is_running():
                logger.warning("generator thread still busy after %.0fs; the generation backend is left open", timeout)
                self.sampler.forget()
            self.sampler.close()
        self.publisher.reset()
        if self._sampler_model_dir:
            import shutil

            shutil.rmtree(self._sampler_model_dir, ignore_errors=True)
            self._sampler_model_dir = None

    def close_generator(self, timeout: float = 10.0) -> None:
        """Stop the job-queue thread (rounds still queued are abandoned; the round in progress gets `timeout` seconds
        to finish); the backend stays for a later train()."""
        if self.generator is not None:
            self.generator.stop(timeout)
            self.generator = None
        self._submitted.clear()
        self._buffered_inputs = None

    # ------------------------------------------------------------------------------------------------------
    # loss and step
    # ------------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs: MicroBatch, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss does not return outputs")
        a = self.args
        ids = torch.cat([inputs.prompt_ids, inputs.completion_ids], dim=1)  # [B, P+T]
        attention_mask = torch.cat([inputs.prompt_mask, inputs.completion_mask], dim=1)  # [B, P+T]
        T = inputs.completion_ids.size(1)
        logps = completion_logps(model, ids, attention_mask, T, a.temperature, padding_free=a.padding_free)  # [B, T]
        out = grpo_loss(
            logps,
            inputs.advantages,
            inputs.loss_mask,
            loss_type=a.loss_type,
            old_per_token_logps=inputs.old_logps,
            ref_per_token_logps=inputs.ref_logps,
            beta=a.beta,
            epsilon_low=a.epsilon,
            epsilon_high=a.epsilon_high,
            importance_weights=inputs.is_weights,
            ctx=LossContext(
                grad_accum_steps=self.current_gradient_accumulation_steps,
                max_completion_length=a.max_completion_length,
                num_items_in_batch=inputs.num_items_in_batch,
                num_processes=self.accelerator.num_processes,
                steps_per_generation=a.steps_per_generation,
            ),
        )
        self._log_loss(out, inputs)
        return out.loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        start = time.perf_counter()
        self._wait_in_step = 0.0
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        except RuntimeError as e:
            if self.accelerator.num_processes > 1 and is_peer_failure(e):
                raise peer_failure_error(e, self.accelerator, self._step, self.state.global_step, self.args) from e
            raise
        self._step += 1
        self._train_step_time += time.perf_counter() - start - self._wait_in_step  # compute only, waits excluded
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["timing/train_step"].append(self._train_step_time)
            self._train_step_time = 0.0
        return loss

    # ------------------------------------------------------------------------------------------------------
    # metrics
    # ------------------------------------------------------------------------------------------------------
    def _masked_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        totals = self.accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum()]).float(), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def _log_loss(self, out, inputs: MicroBatch) -> None:
        m, mask = self._metrics["train"], inputs.loss_mask.float()
        if out.per_token_kl is not None:
            m["kl"].append(self._masked_mean(out.per_token_kl.detach(), mask))
        low, high = out.is_low_clipped.float(), out.is_high_clipped.float()
        m["clip_ratio/low_mean"].append(self._masked_mean(low, mask))
        m["clip_ratio/high_mean"].append(self._masked_mean(high, mask))
        m["clip_ratio/region_mean"].append(self._masked_mean(torch.maximum(low, high), mask))
        # staleness in policy versions: the step trained at minus the step whose weights sampled the row
        stale = self.accelerator.gather((self.state.global_step - inputs.policy_version).float())  # [B·N]
        m["async/staleness"].append(stale.mean().item())
        m["async/staleness_max"].append(stale.max().item())
        m["async/staleness_min"].append(stale.min().item())

    def _log_round(self, rnd: Round, wait: float) -> None:
        m = self._metrics["train"]
        for k, v in rnd.metrics.items():
            m[k].append(v)
        m["timing/generation"].append(rnd.generation_time)
        m["timing/wait_generation"].append(wait)
        if self.generator is not None:
            m["async/pending"].append(float(self.generator.get_pending_count()))
            m["async/completed"].append(float(self.generator.get_completed_count()))
        self._last_samples = rnd.samples

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        metrics = {prefix + k: v for k, v in window_summary(self._metrics[mode]).items()}
        logs = {**logs, **{k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}}
        super().log(logs, start_time)
        self._metrics[mode].clear()
        if self.args.log_completions and self.accelerator.is_main_process and self._last_samples:
            log_completions(
                self._last_samples, self.args.output_dir, self.state.global_step, self.args.num_completions_to_print
            )
            self._last_samples = None  # each round's samples are logged once

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, **kwargs) -> None:
        """Writes `README.md` into `output_dir` (main process): method, base model, reward functions and weights,
        datasets, non-default config, framework versions; `push_to_hub` calls it before uploading."""
        write_model_card(self, model_name=model_name, dataset_name=dataset_name or kwargs.get("dataset"), tags=tags)

    # ------------------------------------------------------------------------------------------------------
    # evaluation
    # ------------------------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Generate G completions per eval prompt once with the current weights, score them, log the means.

        Logs `<prefix>_reward`, `<prefix>_reward_std`, `<prefix>_rewards/<func>`, `<prefix>_completions/mean_length`.
        The current weights are published first (after any round in flight), as the next round would get them.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (none was given to the trainer or to evaluate)")
        if isinstance(dataset, dict):
            out = {}
            for name, ds in dataset.items():
                out.update(self.evaluate(ds, ignore_keys, f"{metric_key_prefix}_{name}"))
            return out
        start = time.perf_counter()
        self._publish()
        metrics = None
        if self.accelerator.is_main_process:
            metrics = self.producer.evaluate(dataset, max(1, self.args.generation_batch_size // self.num_generations))
            metrics["runtime"] = time.perf_counter() - start
        metrics = broadcast_object_list([metrics], from_process=0)[0]
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        metrics["epoch"] = self.state.epoch
        Trainer.log(self, metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ------------------------------------------------------------------------------------------------------
    # lifecycle and checkpoints
    # ------------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`; resuming also restores the pipeline (`pipeline/checkpointing.py`): the run continues with
        exactly the prompts an uninterrupted run would have trained (rounds that were generated ahead but not
        trained at the checkpoint are generated again, from the checkpoint's weights)."""
        if resume_from_checkpoint:
            path = resume_from_checkpoint
            if path is True:
                from transformers.trainer_utils import get_last_checkpoint

                path = get_last_checkpoint(self.args.output_dir)
                if path is None:
                    raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir} has no checkpoint")
            saved = ckpt.read_pipeline_state(path, self._pipeline_state()["geometry"])
            self._step, self._round = saved["micro_steps"], saved["round"]
            logger.warning(
                "resuming from %s: optimizer step %d, round %d%s",
                path,
                saved["policy_version"],
                self._round,
                f" (rounds {saved['submitted_rounds']} were generated ahead and are generated again)"
                if saved["submitted_rounds"]
                else "",
            )
            resume_from_checkpoint = path
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except KeyboardInterrupt:
            # Ctrl-C: stop the job-queue thread without waiting out a round, shut the backend down, re-raise
            logger.warning("interrupted: stopping the generator thread and the generation backend")
            self.close(timeout=2.0)
            raise
        finally:
            self.close_generator()

    def _pipeline_state(self) -> dict:
        a = self.args
        return {
            "micro_steps": self._step,  # training_step calls so far
            "round": self._round,  # next round to train
            "policy_version": self.state.global_step,
            "submitted_rounds": sorted(self._submitted),  # generated ahead, not trained: regenerated on resume
            "geometry": {
                "num_processes": self.accelerator.num_processes,
                "per_device_train_batch_size": a.per_device_train_batch_size,
                "gradient_accumulation_steps": a.gradient_accumulation_steps,
                "steps_per_generation": a.steps_per_generation,
                "num_iterations": a.num_iterations,
                "num_generations": a.num_generations,
                "seed": a.seed,
            },
        }

    def _get_output_dir(self, trial) -> str:
        import os

        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, ckpt.SAVING_DIR) if self._saving_into_staging else run_dir

    def _save_checkpoint(self, model, trial):
        """Atomic (`pipeline/checkpointing.py`): written into a staging folder, renamed into place when complete."""
        try:
            ckpt.atomic_save(
                lambda: Trainer._save_checkpoint(self, model, trial),
                run_dir=Trainer._get_output_dir(self, trial=trial),
                state=self.state,
                args=self.args,
                pipeline_state=self._pipeline_state(),
                barrier=self.accelerator.wait_for_everyone,
                staging=lambda on: setattr(self, "_saving_into_staging", on),
            )
        finally:
            self._saving_into_staging = False

    def _run_epoch(self, *args, **kwargs):
        # Resuming mid-epoch, the Trainer skips batches with accelerate's `skip_first_batches`, which rebuilds a
        # plain dataloader: our look-ahead wrapper skips them itself instead, so peeking stays on the same stream.
        import transformers.trainer as hf_trainer

        original = hf_trainer.skip_first_batches

        def skip(dataloader, num_batches=0):
            if isinstance(dataloader, AsyncDataLoaderWrapper):
                return dataloader.skip_first_batches(num_batches)
            return original(dataloader, num_batches)

        hf_trainer.skip_first_batches = skip
        try:
            return super()._run_epoch(*args, **kwargs)
        finally:
            hf_trainer.skip_first_batches = original
