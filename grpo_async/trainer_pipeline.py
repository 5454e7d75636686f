"""`TrainerPipeline`: the part of `GRPOTrainer` that is not a Trainer override, mixed into it: building the round
pipeline at construction (one call, `pipeline/build.py: build_pipeline`), publishing the weights, the generation
backend, shutting the pipeline down, recording its metrics, its checkpoint state.
"""

from __future__ import annotations

import logging
import sys

from transformers import Trainer

from .algo.objective import PolicyObjective
from .algo.ref_sync import RefModelSyncCallback
from .algo.throughput import throughput_meter
from .interrupt import TrainingInterrupted, debug_enabled, install_exit_hook, interrupted
from .logging_utils import log_completions
from .pipeline import checkpointing as ckpt
from .pipeline.build import AcceleratorCollectives, TrainerLink, build_pipeline
from .pipeline.metrics import ROUND_TOKENS, MetricWindows
from .trainer_setup import bound_collectives
from .trl_attributes import generate_override_rollout, overrides_generate

logger = logging.getLogger("grpo_async.trainer")


class TrainerPipeline:
    """The trainer's pipeline: components built once from the config (`_build_pipeline`, called by
    `GRPOTrainer.__init__` once `Trainer.__init__` made the accelerator), then driven by the Trainer overrides; the
    checkpoint overrides (`_save_checkpoint`, `_get_output_dir`) that save the pipeline's state with the Trainer's."""

    _saving_into_staging = False  # True while Trainer._save_checkpoint writes into the staging folder

    def _build_pipeline(self, ref_model, processing_class, rewards, weights, rollout_func) -> None:
        """Build the objective, the metric windows and every pipeline component (`pipeline/build.py`: which reads
        what, receives what, calls what); `ref_model` is the frozen reference copy (or None)."""
        a = self.args
        bound_collectives(self.accelerator.num_processes, a.ddp_timeout)
        if rollout_func is None and overrides_generate(type(self)):  # TRL's `_generate` override generates
            rollout_func = generate_override_rollout
        self.ref_model = None
        if ref_model is not None:
            self.ref_model = self.accelerator.prepare_model(ref_model, evaluation_mode=True)
        self.num_generations = a.num_generations
        self.num_generations_eval = a.num_generations_eval or a.num_generations  # TRL's attribute
        unwrapped_config = self.accelerator.unwrap_model(self.model).config  # MoE: the load-balancing loss
        self.collectives = AcceleratorCollectives(self.accelerator)  # the one way across the training processes
        self.throughput = throughput_meter(unwrapped_config, self.accelerator, model=self.model)  # perf/*
        self.metric_windows = MetricWindows()  # what `log` reports; step timings
        self._step = 0  # training_step calls
        self._completions_logged_round = None  # the round whose samples `log_completions` printed last
        link = TrainerLink(self, rollout_func)  # what the pipeline reads from this trainer while it runs
        if a.sync_ref_model:  # TR-DPO: ref ← α·policy + (1 − α)·ref every ref_model_sync_steps optimizer steps
            self.add_callback(RefModelSyncCallback.from_config(a, self.ref_model, link.unwrapped_policy))
        pipeline = build_pipeline(  # pipeline/build.py: which component reads what, receives what, calls what
            a,
            link,
            self.collectives,
            tokenizer=processing_class,
            rewards=rewards,
            reward_weights=weights,
            environment=self.environment,
            model_source=self._model_source,
            ref_model=self.ref_model,
            device=self.accelerator.device,
        )
        self.engine, self.publisher, self.producer = pipeline.engine, pipeline.publisher, pipeline.producer
        self.consumer, self.rounds, self.evaluator = pipeline.consumer, pipeline.scheduler, pipeline.evaluator
        self.ref_client = pipeline.ref_client  # None unless a reference server scores π_ref
        # importance sampling inside the objective where the pipeline takes π_old from the training forward
        in_forward = pipeline.importance_sampling
        self.objective = PolicyObjective.from_config(a, unwrapped_config, self.collectives, in_forward)

    def _publish(self) -> None:
        self.rounds.publish(self.accelerator.unwrap_model(self.model), self.state.global_step)

    def sync_weights(self) -> None:
        """Publish the trainer's current weights to the sampler now (every rank must call), e.g. to inspect the
        sampler between `train()` calls. Training publishes by itself at each round boundary."""
        self.publisher.reset()
        self._publish()

    @property
    def backend(self):
        """This process's generation backend: the main process's (servers, openai, `rollout_func`, one process), or
        each rank's own engine (`hf` and in-process vLLM with several processes: an engine on every rank); `None`
        until first used and on a process that does not generate."""
        return self.engine.built if self.engine is not None else None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the job-queue thread (a round in progress is aborted) and shut the backend down (`train()` can run
        again); safe to call again. A thread still stuck after `timeout` seconds (in a reward, say) is joined again
        at interpreter exit; the backend it uses is left open until then."""
        generator_busy = self.rounds.stop(timeout)
        if self.engine is not None:
            if generator_busy:
                logger.warning("generator thread still busy after %.0fs; the generation backend is left open", timeout)
                self.engine.forget()
            self.engine.close()
        self.publisher.reset()

    def record_metric(self, key: str, value: float) -> None:
        """Record a training metric of the pipeline, logged (averaged over the window) at the next `log`. A round's
        token count goes to `state.num_input_tokens_seen`, logged as TRL's `num_tokens` (the running total, counted
        when a round is first trained, as TRL counts at generation)."""
        if key == ROUND_TOKENS:
            self.state.num_input_tokens_seen += int(value)
            self.metric_windows.set_total("num_tokens", self.state.num_input_tokens_seen)
        else:
            self.metric_windows.record(key, value)

    def _interrupted(self) -> TrainingInterrupted:
        """Ctrl-C in `train()` (`grpo_async/interrupt.py`): stop the job-queue thread without waiting out a round,
        shut the backend down (a second Ctrl-C skips what is left of that), print one line on the main process and
        return the `TrainingInterrupted` to raise; uncaught, it ends the process with exit status 130 at once
        (`GRPO_ASYNC_DEBUG=1`: the interpreter prints the whole traceback and ends as it would by itself)."""
        logger.info("interrupted: stopping the generator thread and the generation backend")
        try:
            self.close(timeout=2.0)
        except KeyboardInterrupt:
            logger.info("interrupted again: the generation backend is left to the process exit")
        err = interrupted(self.state.global_step, self.state.max_steps, self.args.output_dir, self.args.save_strategy)
        if self.accelerator.is_main_process:
            print(err, file=sys.stderr, flush=True)
        if not debug_enabled():
            install_exit_hook()
        return err

    def complete(self, prompts: list, temperature: float = 0.0, max_tokens: int | None = None) -> list[str]:
        """The texts this trainer's generation engine writes for `prompts` with the policy's current weights (the
        sampler's: after `train()`, the trained ones), one per prompt: chat messages or plain strings, templated as the
        training prompts are; greedy by default; `max_tokens` defaults to `max_completion_length`. For measuring a
        task's accuracy before and after training with your own scorer (README, "Train on your own task")."""
        from .generation.base import SamplingConfig

        sampling = SamplingConfig(
            n=1, max_tokens=max_tokens or self.args.max_completion_length, temperature=temperature
        )
        _, outs = self.producer.generate_once(list(prompts), sampling)
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        return tokenizer.batch_decode([c.completion_ids for c in outs], skip_special_tokens=True)

    def _log_completions(self) -> None:
        """`log_completions`: print and save the samples of the last round generated, once (main process)."""
        samples = self.rounds.last_samples
        if not (self.args.log_completions and self.accelerator.is_main_process and samples):
            return
        if samples.get("round") == self._completions_logged_round:
            return  # each round's samples are logged once (they stay readable as TRL's `_logs`)
        a, step = self.args, self.state.global_step
        log_completions(samples, a.output_dir, step, a.num_completions_to_print, a.log_unique_prompts)
        self._completions_logged_round = samples.get("round")

    def _pipeline_state(self) -> dict:
        return {
            "micro_steps": self._step,  # training_step calls so far
            "policy_version": self.state.global_step,
            "objective": self.objective.state_dict(),  # the adaptive entropy coefficient
            **self.rounds.state_dict(),
            "geometry": ckpt.batch_geometry(self.args, self.accelerator.num_processes),
        }

    def _restore_pipeline(self, checkpoint: str) -> None:
        """Resume the pipeline from `checkpoint` (`pipeline/checkpointing.py`): the rounds, the micro-step count,
        the objective's adaptive state; raises when the batch geometry changed since."""
        saved = ckpt.read_pipeline_state(checkpoint, self._pipeline_state()["geometry"])
        self._step = saved["micro_steps"]
        self.rounds.load_state_dict(saved)
        self.objective.load_state_dict(saved.get("objective"))

    # ---- checkpoints (Trainer overrides) --------------------------------------------------------------------------
    def _get_output_dir(self, trial) -> str:
        import os

        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, ckpt.SAVING_DIR) if self._saving_into_staging else run_dir

    def _save_checkpoint(self, model, trial):
        """Atomic (`pipeline/checkpointing.py`): written into a staging folder, renamed into place when complete.
        As TRL, the model card in `output_dir` is refreshed first (a hub push of the checkpoint uploads it)."""
        self.create_model_card()
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
