"""`RoundProducer`: a `RoundRequest` in, a `Round` out — tokenize, generate (or run environment turns), score,
compute grouped advantages, pad. Runs in the job-queue thread on the main process; knows nothing of the Trainer.

Worked example (G = 2, one prompt "Say b", a reward of 1 per "b"):

```txt
RoundRequest(round_id=3, rows=[{"prompt": "Say b"}, {"prompt": "Say b"}])
  tokenize   → prompt_ids [[5, 9, 2]]                     (chat prompts: the chat template, generation prompt added)
  generate   → completions "bb", "a"                       (n = G per prompt, on the weights the sampler holds: v)
  rewards    → [[2.0], [0.0]]  → combined [2.0, 0.0]      ([R, F] → [R], weighted sum)
  advantages → [0.707, -0.707]                            (group mean / std, `scale_rewards`)
Round(round_id=3, policy_version=v, batch=MicroBatch(prompt_ids [2, 3], completion_ids [2, 2], ...), metrics={...})
```
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..algo.advantages import aggregate_advantages, combine_rewards, group_std_is_zero, nanstd
from ..algo.router_replay import stack_routing
from ..algo.sampling_support import pad_kept_sets
from ..envs.rollout import template_ids
from ..envs.tools import tool_metrics
from ..generation.base import Completion, GenerationAborted, SamplingConfig, derive_seed
from ..generation.shared import SharedBackend
from ..rewards import RewardLogs, score_completions
from .metrics import ROUND_TOKENS, terminated_length_metrics
from .rows import chunk_slices, pad
from .types import MicroBatch, Round, RoundRequest
from .vision_prompts import call_images, is_processor, png_images, row_images, tokenize_with_images, with_vision

#: a dataset column whose dict (per row, the same for a prompt's G rows) is merged over the run's generation_kwargs
#: for that prompt's requests, e.g. `{"min_tokens": 40, "max_tokens": 40}` (vLLM `SamplingParams` fields)
ROW_SAMPLING = "generation_kwargs"


def is_conversational(prompt) -> bool:
    """A prompt given as chat messages (`[{"role": ..., "content": ...}, ...]`)."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


@dataclass
class ProducerSettings:
    """What the producer needs of the config (no config object below the trainer)."""

    num_generations: int  # G
    sampling: SamplingConfig  # n is set per call
    max_completion_length: int
    max_prompt_length: int | None
    prompt_truncation: str  # "left" | "error"
    rollout_micro_batch_size: int  # completions per generate call, over the whole round
    scale_rewards: str
    multi_objective_aggregation: str  # "sum_then_normalize" | "normalize_then_sum"
    num_generations_eval: int  # completions per prompt in `evaluate`
    mask_truncated_completions: bool
    mask_env_responses: bool
    reward_timeout: float | None
    syncs_weights: bool  # False: the sampler keeps its initial weights (version 0)
    seed: int | None = None  # sampling seeds derived from (seed, round, row): `_sampling`; None: unseeded
    chat_template_kwargs: dict | None = None  # extra apply_chat_template arguments (GRPOConfig's)
    log_multimodal: bool = False  # a VLM's rows carry their images (PNG) into the completions table
    router_replay: str = "off"  # "record" | "rollout": every completion carries its sampler's experts

    @classmethod
    def from_config(cls, a) -> ProducerSettings:
        """From a `GRPOConfig`."""
        sampling = SamplingConfig(
            max_tokens=a.max_completion_length, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p
        )
        sampling.stop = a.stop
        sampling.repetition_penalty = a.repetition_penalty
        sampling.extra = dict(a.generation_kwargs) if a.generation_kwargs else None
        return cls(
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
            chat_template_kwargs=dict(a.chat_template_kwargs) if a.chat_template_kwargs else None,
            log_multimodal=a.log_multimodal and a.log_completions,
            reward_timeout=a.reward_timeout,
            syncs_weights=a.syncs_weights,
            # completion seeds: (seed, round, row); README Reproducibility
            seed=a.seed if a.seeded_generation else None,
            router_replay=getattr(a, "router_replay", "off"),
        )


class RoundProducer:
    """Turns requests into rounds.

    Args:
        backend (`SharedBackend`): the sampler (shared with the publisher and evaluation; used under its lock).
        tokenizer: the processing class (chat template, pad token, decoding).
        reward_funcs (`list[callable]`), reward_names (`list[str]`), reward_weights (`torch.Tensor` `[F]`).
        settings (`ProducerSettings`).
        environment (*optional*): a multi-turn environment (`grpo_async.envs`).
        extra_columns (`Callable[[], dict]`, *optional*): values passed to every reward call besides the dataset's
            columns (the trainer passes `trainer_state`, as TRL does).
        rollout_func (`Callable[[list], dict]`, *optional*): generates instead of the backend (TRL's `rollout_func`
            with the trainer bound; `grpo_async.envs.rollout.run_rollout_func`), called with the round's prompts.
    """

    def __init__(
        self,
        backend: SharedBackend,
        tokenizer,
        reward_funcs: Sequence[Callable],
        reward_names: Sequence[str],
        reward_weights: torch.Tensor,
        settings: ProducerSettings,
        environment=None,
        extra_columns: Callable[[], dict] | None = None,
        rollout_func: Callable[[list], dict] | None = None,
    ):
        self.backend = backend
        #: a vision-language model's processor (rows with images); `tokenizer` is then the processor's tokenizer
        self.processor = tokenizer if is_processor(tokenizer) else None
        self.tokenizer = tokenizer.tokenizer if self.processor is not None else tokenizer
        self.reward_funcs, self.reward_names, self.reward_weights = (
            list(reward_funcs),
            list(reward_names),
            reward_weights,
        )
        self.s = settings
        self.environment = environment
        self.extra_columns = extra_columns or dict
        self.rollout_func = rollout_func
        self._aborted = threading.Event()

    def prompt_of(self, row: dict):
        """The row's prompt; with an environment, a row without one (the environment owns the data: its `reset`
        writes the prompt, as in TRL) gets an empty user message, which stays out of the environment's row."""
        if "prompt" in row or self.environment is None:
            return row["prompt"]
        return [{"role": "user", "content": ""}]

    # ---- shutdown -----------------------------------------------------------------------------------------------
    def abort(self) -> None:
        """Interrupt the round in progress (called from another thread at shutdown): the backend aborts its
        generation (`GenerationBackend.abort`), and a round whose generation already finished is not scored: the
        call raises `GenerationAborted` instead. Until `resume()`."""
        self._aborted.set()
        self.backend.abort()

    def resume(self) -> None:
        """Undo `abort` (the generator thread has exited): rounds and evaluation generate again."""
        self._aborted.clear()
        self.backend.resume()

    def build_engine(self) -> None:
        """Build the backend now, on the calling thread (no-op when built). The scheduler calls it on the trainer's
        thread before a `train()` submits its first round: an in-process vLLM engine on every rank starts with
        collectives over the trainer's process group (`VLLMColocateBackend`), which must run at the same point on
        every rank, not on a generator thread beside the trainer's own collectives."""
        if self.backend is not None:
            self.backend.get()

    def start_streaming(self) -> None:
        """Stream mode: build the backend and make it take concurrent `generate` calls (its `start_streaming()`, where
        it has one: the vLLM backends start their engine loop). Which backends stream is their `BackendSpec.streams`,
        checked by the config before a trainer is built."""
        start = getattr(self.backend.get(), "start_streaming", None)
        if start is not None:
            start()

    def _check_aborted(self, round_id: int) -> None:
        if self._aborted.is_set():
            raise GenerationAborted(f"round {round_id} aborted: the generator is shutting down")

    # ---- pieces -------------------------------------------------------------------------------------------
    def tokenize_prompts(self, prompts: list, template_kwargs: dict | None = None) -> tuple[list[list[int]], int]:
        """Token ids of each prompt, left-truncated to `max_prompt_length` (counted) or refused, as configured;
        `template_kwargs` (e.g. `tools=`) go to the chat template."""
        out, truncated = [], 0
        limit = self.s.max_prompt_length
        for p in prompts:
            if is_conversational(p):
                kwargs = {**(self.s.chat_template_kwargs or {}), **(template_kwargs or {})}
                ids = template_ids(self.tokenizer, p, add_generation_prompt=True, **kwargs)
            elif isinstance(p, str):
                ids = self.tokenizer(p)["input_ids"]
            else:
                raise TypeError(f"prompt must be a string or a list of chat messages, got {type(p).__name__}")
            if limit is not None and len(ids) > limit:
                if self.s.prompt_truncation == "error":
                    raise ValueError(f"a prompt has {len(ids)} tokens > max_prompt_length={limit}: {p!r:.200}")
                ids, truncated = ids[-limit:], truncated + 1
            out.append(ids)
        return out, truncated

    def tokenize_rows(self, prompts: list, rows: list[dict]) -> tuple[list[list[int]], int, list | None]:
        """`tokenize_prompts`, with each prompt's images (`rows[k]`: prompt k's row; its `image` / `images`
        column, `pipeline/vision_prompts.py`) when the processing class is a processor: `(prompt_ids, truncated,
        media)`, `media[k]` prompt k's `PromptImages` (None: a text-only prompt), `media` None without images."""
        images = [row_images(r) for r in rows]
        if self.processor is None or not any(images):
            if any(images):
                raise ValueError(
                    "the dataset has images (an `image` / `images` column) but the processing_class is a tokenizer: "
                    "pass the model's processor as processing_class (as with TRL; loaded by default for a model "
                    "with a vision_config)"
                )
            return (*self.tokenize_prompts(prompts), None)
        if self.environment is not None or self.rollout_func is not None:
            raise ValueError("rows with images cannot go through an environment or a rollout_func here (text only)")
        ids, media = [], []
        for p, imgs in zip(prompts, images, strict=True):
            one, m = tokenize_with_images(self.processor, p, imgs or [], self.s.chat_template_kwargs)
            limit = self.s.max_prompt_length
            if limit is not None and len(one) > limit:  # never cut: the image tokens must match the images
                raise ValueError(
                    f"a prompt with images has {len(one)} tokens > max_prompt_length={limit}; prompts with images "
                    "are not truncated (their image tokens must match the pixel values): raise max_prompt_length"
                )
            ids.append(one)
            media.append(m if imgs else None)
        return ids, 0, media

    def _sampling(self, n: int, round_id: int, row: int) -> SamplingConfig:
        """The sampling of a call whose first completion is row `row` of round `round_id`: with a run seed, row r of
        the round samples with seed `derive_seed(seed, round_id) + r` (`SamplingConfig.seed`), whatever the chunking
        into calls, the thread timing or the process (evaluation uses negative round ids)."""
        s = SamplingConfig(**vars(self.s.sampling))
        s.n = n
        if self.s.seed is not None:
            s.seed = derive_seed(self.s.seed, round_id) + row
        return s

    def generate_once(
        self, prompts: list, sampling: SamplingConfig | None = None
    ) -> tuple[list[list[int]], list[Completion]]:
        """One completion per prompt, outside any round (TRL's `GRPOTrainer._generate`, `GRPOTrainer.complete`): the
        prompts tokenized as a round's are, one call to the backend, with `sampling` or the run's (a seeded run then
        samples with round −1's seeds). Returns `(prompt_ids [N][P_i], completions [N])`."""
        prompt_ids, _ = self.tokenize_prompts(prompts)
        with self.backend.lock:
            return prompt_ids, self.backend.get().generate(prompt_ids, sampling or self._sampling(1, -1, 0))

    def generate(
        self,
        prompts: list,
        rows: list[dict],
        prompt_ids: list[list[int]],
        round_id: int,
        G: int,
        first_row: int = 0,
        concurrent: bool = False,
        media: list | None = None,
    ):
        """Completions grouped by prompt (`[R]`), the sampler's version, and the number of generate calls. Holds the
        backend's lock for the whole round, so the round runs on one version of the weights; `concurrent` (stream
        mode: one prompt group per call, from several threads at once) does not: the backend is then one that takes
        concurrent calls (`start_streaming`), and a publish either waits for the groups running
        (`GroupStream.held`) or loads between two engine steps (in-flight, the completions' `versions` say so).
        `first_row`: the round row of `rows[0]` (the sampling seeds); `media[k]`: prompt k's images (a VLM)."""
        with contextlib.nullcontext() if concurrent else self.backend.lock:
            backend = self.backend.get()
            version = backend.version if self.s.syncs_weights and backend.version is not None else 0
            if self.rollout_func is not None:  # the user generates: one completion per row, G copies of each prompt
                from ..envs.rollout import run_rollout_func

                stop = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id}
                return run_rollout_func(self.rollout_func, [self.prompt_of(r) for r in rows], stop), version, 1
            if self.environment is not None:
                from ..envs import run_rollouts

                results = run_rollouts(
                    backend,
                    self.tokenizer,
                    self.environment,
                    prompts,
                    prompt_ids,
                    rows,
                    self._sampling(G, round_id, first_row),
                    G,
                    self.s.max_completion_length,
                    tokenize=lambda messages, kw: self.tokenize_prompts([messages], kw)[0][0],
                    chat_template_kwargs=self.s.chat_template_kwargs,
                )
                return [r.to_completion() for r in results], version, max(r.turns for r in results)
            size = self.s.rollout_micro_batch_size
            if concurrent:  # one group (or a few): one call, n = G
                calls = [(prompt_ids, G, 0)]
            elif size % G == 0:  # whole groups per call: prompts with n = G
                calls = [(prompt_ids[sl], G, sl.start * G) for sl in chunk_slices(len(prompt_ids), size // G)]
            else:  # a chunk may cut a group: every prompt G times with n = 1
                repeated = [p for p in prompt_ids for _ in range(G)]
                calls = [(repeated[sl], 1, sl.start) for sl in chunk_slices(len(repeated), size)]
            own = [r.get(ROW_SAMPLING) for r in rows]  # [R] a row's own generation_kwargs (None: the run's)
            if any(k is not None for k in own) and not getattr(backend, "takes_per_prompt_sampling", False):
                raise ValueError(
                    f"the dataset's {ROW_SAMPLING!r} column sets sampling per prompt, which {type(backend).__name__} "
                    "cannot do (the vLLM backends can); drop the column or use generation_backend 'vllm' / "
                    "'vllm_server' / 'openai'"
                )
            completions: list[Completion] = []
            for chunk, n, row in calls:  # (chunk, n, the request row of the call's first completion)
                sampling = self._sampling(n, round_id, first_row + row)
                if any(k is not None for k in own):
                    sampling.per_prompt = [own[row + i * n] for i in range(len(chunk))]
                completions += backend.generate(chunk, sampling, **call_images(backend, media, row, n, len(chunk), G))
            return completions, version, len(calls)

    def score(self, rows: list[dict], completions: list[Completion], logs: RewardLogs | None = None) -> torch.Tensor:
        """Decode completions (chat-formatted for chat prompts) and call the reward functions. Returns `[R, F]`.
        What they log through TRL's `log_extra` / `log_metric` goes into `logs` (dropped when `None`)."""
        completion_ids = [c.completion_ids for c in completions]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        for c, t in zip(completions, texts):
            c.text = t
        prompts = [c.extra.get("prompt") or self.prompt_of(r) for r, c in zip(rows, completions, strict=True)]
        formatted = [
            c.extra["messages"]  # multi-turn: the assistant's and the environment's messages
            if "messages" in c.extra
            else ([{"role": "assistant", "content": t}] if is_conversational(p) else t)
            for p, t, c in zip(prompts, texts, completions, strict=True)
        ]
        columns: dict[str, Any] = {
            k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")
        }
        columns.update(self.extra_columns())
        logs = logs if logs is not None else RewardLogs()
        columns.update(log_extra=logs.log_extra, log_metric=logs.log_metric)
        if completions and "state" in completions[0].extra:  # multi-turn: each rollout's final environment state
            columns["env_state"] = [c.extra["state"] for c in completions]
        for key in completions[0].extra.get("columns", {}) if completions else ():  # environment / rollout_func fields
            columns[key] = [c.extra["columns"][key] for c in completions]
        try:
            return score_completions(
                self.reward_funcs,
                self.reward_names,
                prompts,
                formatted,
                completion_ids,
                columns,
                timeout=self.s.reward_timeout,
                abort=self._aborted,  # the generator's shutdown does not wait out a hung reward
            )
        finally:  # e.g. environment_factory instances go back to their pool
            if getattr(self.environment, "release", None) is not None and "env_state" in columns:
                self.environment.release(columns["env_state"])

    # ---- the round ----------------------------------------------------------------------------------------
    def __call__(
        self, request: RoundRequest, concurrent: bool = False, on_sampled: Callable[[], None] | None = None
    ) -> Round:
        """The round of `request`; `concurrent`: one of several calls running at once (stream mode, a request per
        prompt group; see `generate`). `on_sampled` is called once the completions are in and the backend is
        released (`AsyncBatchGenerator.wait_until_sampled`: a weight load may go on while this round is scored)."""
        G, rows = self.s.num_generations, request.rows
        for g in range(0, len(rows), G):
            if any(self.prompt_of(rows[g + i]) != self.prompt_of(rows[g]) for i in range(G)):
                raise RuntimeError(f"round {request.round_id}: rows {g}..{g + G - 1} are not {G} copies of a prompt")
        prompts = [self.prompt_of(r) for r in rows[::G]]
        prompt_ids, truncated, media = self.tokenize_rows(prompts, rows[::G])
        self._check_aborted(request.round_id)
        t0 = time.perf_counter()
        completions, version, rollout_calls = self.generate(
            prompts, rows, prompt_ids, request.round_id, G, request.first_row, concurrent, media
        )
        t_gen = time.perf_counter() - t0
        if on_sampled is not None:
            on_sampled()
        self._check_aborted(request.round_id)  # shutting down: the rewards (maybe slow) are not computed
        t0 = time.perf_counter()
        logs = RewardLogs()
        rewards_per_func = self.score(rows, completions, logs)  # [R, F]
        logs.check_extra(len(rows))
        t_reward = time.perf_counter() - t0
        rewards = combine_rewards(rewards_per_func, self.reward_weights)  # [R] weighted sum: logged, as in TRL
        advantages = aggregate_advantages(
            rewards_per_func, self.reward_weights, G, self.s.scale_rewards, self.s.multi_objective_aggregation
        )  # [R]

        prompt_rep = [c.extra.get("prompt_ids") or prompt_ids[i // G] for i, c in enumerate(completions)]  # [R]
        batch = self._batch(prompt_rep, completions, advantages, version, request.round_id, request.first_row)
        batch = with_vision(batch, media and [media[i // G] for i in range(len(completions))])  # each row's images
        completion_mask = batch.completion_mask  # [R, T] tokens that exist
        metrics = self._metrics(completions, rewards, rewards_per_func, completion_mask, G)
        metrics.update(
            {
                "prompts/truncated": float(truncated),
                "timing/rollout": t_gen,
                "chunks/rollout": float(rollout_calls),
                "timing/rewards": t_reward,
                ROUND_TOKENS: float(batch.prompt_mask.sum() + completion_mask.sum()),  # TRL's num_tokens
                **logs.metric_means(),
            }
        )
        samples = {
            "prompt": [c.extra.get("prompt") or self.prompt_of(r) for r, c in zip(rows, completions, strict=True)],
            "completion": [c.text for c in completions],
            "rewards": {name: rewards_per_func[:, i].tolist() for i, name in enumerate(self.reward_names)},
            "reward": rewards.tolist(),
            "advantage": advantages.tolist(),
            "policy_version": batch.policy_version.tolist(),  # each row's oldest token
            "round": request.round_id,
            "extra": logs.extra,  # log_extra columns
        }
        if media is not None and self.s.log_multimodal:  # TRL's log_multimodal: each row's images, as PNG bytes
            samples["images"] = [png_images(media[i // G]) for i in range(len(rows))]
        return Round(
            request.round_id,
            int(batch.policy_version.min()),
            batch,
            metrics,
            samples,
            rewards_per_func=rewards_per_func,
        )

    def _token_versions(self, completions: list[Completion], version: int) -> list[list[int]]:
        """`[R][T_i]` the policy version of each token: the backend's per-token `versions` when it knows them (and the
        sampler receives weights at all), else `version` for every token."""
        out = []
        for c in completions:
            known = c.versions is not None and self.s.syncs_weights
            if known and len(c.versions) != len(c.completion_ids):
                raise RuntimeError(f"a completion has {len(c.completion_ids)} tokens but {len(c.versions)} versions")
            out.append(list(c.versions) if known else [version] * len(c.completion_ids))
        return out

    def _batch(
        self,
        prompt_rep: list,
        completions: list[Completion],
        advantages,
        version: int,
        round_id: int,
        first_row: int = 0,
    ):
        """The `MicroBatch` `[R]` of completions (row i after prompt `prompt_rep[i]`), padded, with the loss mask;
        row i is row `first_row + i` of round `round_id`'s request. A row's `policy_version` is its oldest token's."""
        R = len(completions)
        versions = self._token_versions(completions, version)  # [R][T_i]
        oldest = [min(v) if v else version for v in versions]  # [R]
        completion_ids = [c.completion_ids for c in completions]
        completion_mask = pad([[1] * len(c) for c in completion_ids], 0)  # [R, T] tokens that exist
        truncated_rows = torch.tensor([c.finish_reason == "length" for c in completions])  # [R]
        loss_mask = completion_mask.clone()  # [R, T] tokens trained on
        if self.s.mask_env_responses and completions and "env_mask" in completions[0].extra:  # env/tool tokens:
            loss_mask *= pad([c.extra["env_mask"] for c in completions], 0)  # [R, T]  not trained
        if self.s.mask_truncated_completions:
            loss_mask[truncated_rows] = 0
        routed_experts = None  # [R, T, L, k] the sampler's experts (GRPOConfig.router_replay)
        if self.s.router_replay != "off":
            missing = sum(c.routed_experts is None for c in completions)
            if missing:
                raise RuntimeError(
                    f"GRPOConfig.router_replay={self.s.router_replay!r}: {missing} of {len(completions)} completions "
                    "came back without the experts their sampler routed them to (the generation backend did not "
                    "record them)"
                )
            routed_experts = stack_routing([c.routed_experts for c in completions], completion_mask.size(1))
        return MicroBatch(
            prompt_ids=pad(prompt_rep, self.tokenizer.pad_token_id, side="left"),  # [R, P]
            prompt_mask=pad([[1] * len(p) for p in prompt_rep], 0, side="left"),  # [R, P]
            completion_ids=pad(completion_ids, self.tokenizer.pad_token_id),  # [R, T]
            completion_mask=completion_mask,
            loss_mask=loss_mask,
            rollout_logps=pad([c.logprobs for c in completions], 0.0, dtype=torch.float32),  # [R, T]
            advantages=advantages,
            policy_version=torch.tensor(oldest, dtype=torch.long),  # [R]
            round_id=torch.full((R,), round_id, dtype=torch.long),  # [R]
            row_index=first_row + torch.arange(R),  # [R]
            token_version=pad(versions, version, dtype=torch.long),  # [R, T]
            sampling_mask=pad_kept_sets([c.sampling_mask for c in completions], completion_mask.size(1)),  # [R,T,K]
            support_known=torch.tensor([c.sampling_mask is not None for c in completions], dtype=torch.bool),  # [R]
            routed_experts=routed_experts,
            num_items_in_batch=float(loss_mask.sum()),
        )

    def _metrics(self, completions, rewards, rewards_per_func, completion_mask, G) -> dict[str, float]:
        R = len(completions)
        lengths = completion_mask.sum(1).float()  # [R]
        # a completion is clipped when a token limit cut it, or (multi-turn) cut one of its assistant turns
        clipped = [c.finish_reason == "length" or c.extra.get("clipped_turns", 0) > 0 for c in completions]
        m = {
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": sum(clipped) / R,
            **terminated_length_metrics(lengths.tolist(), clipped),  # TRL's completions/*_terminated_length
            "reward": torch.nanmean(rewards).item(),
            "reward_std": nanstd(rewards).item(),
            "frac_reward_zero_std": group_std_is_zero(rewards, G).float().mean().item(),
        }
        if self.environment is not None:  # multi-turn: assistant turns, environment tokens, rollouts cut by max_turns
            turns = torch.tensor([float(c.extra["turns"]) for c in completions])  # [R]
            env_tokens = sum(len(c.extra["env_mask"]) - sum(c.extra["env_mask"]) for c in completions)
            m["env/turns/mean"] = turns.mean().item()
            m["env/turns/max"] = turns.max().item()
            m["env/env_tokens_frac"] = env_tokens / max(1.0, completion_mask.sum().item())
            m["env/max_turns_ratio"] = sum(c.finish_reason == "max_turns" for c in completions) / R
            m.update(tool_metrics([c.extra.get("state") for c in completions]))  # TRL's tools/* (tool environments)
        for i, name in enumerate(self.reward_names):
            m[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
            m[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
        return m

    def evaluate(self, dataset, chunk_prompts: int, batch_rows: int | None = None) -> tuple[dict, list[MicroBatch]]:
        """Generate `num_generations_eval` completions per prompt of `dataset` on the weights the sampler holds,
        `chunk_prompts` prompts at a time, score them. Returns the means, and, when `batch_rows` is given, the rows
        as TRL's eval batches of `batch_rows` rows (advantages computed within each batch, as TRL does), in order."""
        import itertools

        G = self.s.num_generations_eval
        rewards_all, per_func_all, lengths, rows_kept = [], [], [], []
        media_kept: list = []  # a VLM: each kept row's prompt images
        stream = iter(dataset)  # a Dataset or a streaming IterableDataset alike, in order
        for lo in itertools.count(0, chunk_prompts):
            rows = list(itertools.islice(stream, chunk_prompts))
            if not rows:
                break
            prompts = [self.prompt_of(r) for r in rows]
            prompt_ids, _, media = self.tokenize_rows(prompts, rows)
            rows_rep = [r for r in rows for _ in range(G)]
            completions, _, _ = self.generate(prompts, rows_rep, prompt_ids, -1 - lo, G, media=media)
            per_func = self.score(rows_rep, completions)  # [n·G, F]
            per_func_all.append(per_func)
            rewards_all.append(combine_rewards(per_func, self.reward_weights))
            lengths += [len(c.completion_ids) for c in completions]
            if batch_rows is not None:
                rows_kept += [(c.extra.get("prompt_ids") or prompt_ids[i // G], c) for i, c in enumerate(completions)]
                media_kept += [media and media[i // G] for i in range(len(completions))]
        if not rewards_all:
            raise ValueError("evaluate(): the eval dataset yielded no prompts")
        rewards, per_func = torch.cat(rewards_all), torch.cat(per_func_all)
        batches = []
        for lo in range(0, len(rows_kept), batch_rows or 1):  # rows_kept is empty without batch_rows
            kept = rows_kept[lo : lo + batch_rows]
            advantages = aggregate_advantages(
                per_func[lo : lo + len(kept)],
                self.reward_weights,
                G,
                self.s.scale_rewards,
                self.s.multi_objective_aggregation,
            )  # [b]
            batch = self._batch([p for p, _ in kept], [c for _, c in kept], advantages, 0, -1)
            batches.append(with_vision(batch, media_kept[lo : lo + len(kept)]))
        metrics = {
            "reward": torch.nanmean(rewards).item(),
            "reward_std": nanstd(rewards).item(),
            "completions/mean_length": sum(lengths) / len(lengths),
            **{f"rewards/{n}": torch.nanmean(per_func[:, i]).item() for i, n in enumerate(self.reward_names)},
        }
        return metrics, batches
