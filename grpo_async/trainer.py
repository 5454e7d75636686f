"""`GRPOTrainer`: a `transformers.Trainer` whose inputs are generated ahead of training by a background thread.

Orchestration only: the math lives in `algo/`, the thread in `rollout/batch_generator.py`, row handling in
`rollout/distribute.py`, generation in `generation/`, weight collection in `weight_sync/`.

Timeline with `num_batches_ahead = 1` (one round = steps_per_generation × μ micro-steps):

```txt
trainer  | submit r0,r1 | wait r0 | train r0 ........ | submit r2 | train r1 ........ | submit r3 | train r2 ...
generator|              | gen r0  | gen r1 (weights@0)|           | gen r2 (weights@r1 start)  | gen r3 ...
```
Round r is generated from the weights the trainer had when it started round r − k (staleness ≤ k rounds).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import threading
import time
from collections import defaultdict
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, gather_object
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Trainer
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from .algo.advantages import combine_rewards, compute_advantages, group_std_is_zero, nanstd
from .algo.logprobs import completion_logps
from .algo.loss import LossContext, grpo_loss, importance_sampling_weights
from .algo.packing import check_isolation
from .config import GRPOConfig
from .data.async_loader import AsyncDataLoaderWrapper
from .data.sampler import RepeatSampler
from .generation.base import SamplingConfig
from .generation.ref_client import RefLogpsClient
from .logging_utils import MetricsJsonlCallback, log_completions
from .model_card import write_model_card
from .rewards import prepare_reward_funcs, score_completions
from .rollout.aggregation import MicroBatchBuffer, apply_in_chunks, chunk_slices, reuse_order, split_back
from .rollout.batch_generator import AsyncBatchGenerator, BatchRequest
from .rollout.distribute import num_rows, pad, process_slice, select_rows, shuffle_rows, split_rows, trim_padding
from .weight_sync.collect import collect_state_dict

logger = logging.getLogger(__name__)

#: written into every checkpoint folder: the pipeline's position (micro-steps, rounds, rounds in flight, geometry)
PIPELINE_STATE_FILE = "grpo_async_state.json"
#: checkpoints are written under `output_dir/SAVING_DIR/checkpoint-N`, then renamed into place (atomic save)
SAVING_DIR = "_grpo_async_saving"  # "_*" is left out of the Trainer's hub uploads of output_dir


def _identity(rows):
    return rows


_PEER_FAILURE_SIGNS = ("connection closed by peer", "connection reset by peer", "gloo", "nccl")


def _is_peer_failure(e: BaseException) -> bool:
    """A collective failed because another process died or stalled (gloo/NCCL errors, store timeouts); not an error
    of our own pipeline (generation, rewards) that merely mentions one."""
    if str(e).startswith("Async generation"):
        return False
    dist_error = getattr(torch.distributed, "DistError", ())
    return isinstance(e, dist_error) or any(s in str(e).lower() for s in _PEER_FAILURE_SIGNS)


def _is_conversational(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


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
    _saving_into_staging = False  # True while Trainer._save_checkpoint writes into SAVING_DIR
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
        model_id = model if isinstance(model, str) else model.config._name_or_path
        self._model_source = model if isinstance(model, str) else None  # what engines that load a model read
        if isinstance(model, str):
            kwargs = dict(args.model_init_kwargs or {})
            kwargs.setdefault("trust_remote_code", args.trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(model, **kwargs)
        elif args.model_init_kwargs:
            raise ValueError("GRPOConfig.model_init_kwargs only applies when `model` is a name or path")
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model_id, trust_remote_code=args.trust_remote_code)
        if getattr(processing_class, "pad_token", None) is None:
            raise ValueError(
                f"The tokenizer of {model_id!r} has no pad token. Set one before creating the trainer, e.g. "
                "`tokenizer.pad_token = tokenizer.eos_token`."
            )
        processing_class.padding_side = "left"
        if train_dataset is not None:
            self._check_dataset(train_dataset, args, "train_dataset")
        if eval_dataset is not None:
            self._check_dataset(eval_dataset, args, "eval_dataset", min_rows=1)

        self.is_peft = peft_config is not None
        ref_model = None
        # the reference: a frozen server (ref_server_url), the PEFT base model, or a frozen copy of the policy
        if args.beta > 0 and not self.is_peft and args.ref_server_url is None:
            ref_model = copy.deepcopy(model).eval()
            for p in ref_model.parameters():
                p.requires_grad_(False)
        if self.is_peft:
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
        self.reward_funcs, self.reward_func_names = prepare_reward_funcs(reward_funcs)
        weights = args.reward_weights
        if weights is not None and len(weights) != len(self.reward_funcs):
            raise ValueError(
                f"GRPOConfig.reward_weights has {len(weights)} values for {len(self.reward_funcs)} reward functions"
            )
        self.reward_weights = torch.tensor(weights or [1.0] * len(self.reward_funcs), dtype=torch.float32)
        self.environment = self._make_environment(environment, tools, train_dataset, eval_dataset)

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
        self._bound_collectives()
        self.ref_model = None
        if ref_model is not None:
            self.ref_model = self.accelerator.prepare_model(ref_model, evaluation_mode=True)
        self.ref_client = None
        if args.beta > 0 and args.ref_server_url is not None:
            self.ref_client = RefLogpsClient(
                args.ref_server_url, args.ref_server_api_key or args.vllm_api_key, args.vllm_server_timeout
            )

        G = args.num_generations
        self.num_generations = G
        self.generate_every = args.steps_per_generation * args.num_iterations
        # micro-batch index trained at each micro-step of a round: a b | a b ("epoch") or a a b b ("consecutive")
        self._reuse_order = reuse_order(list(range(args.steps_per_generation)), args.num_iterations, args.reuse_order)
        self.compute_old_logps = (
            args.num_iterations > 1
            or args.steps_per_generation > args.gradient_accumulation_steps
            or args.importance_sampling_correction  # π_old of the IS ratio π_old / π_sampler
        )
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._step = 0  # training_step calls
        self._epoch_seen = None
        self._epoch_call = 0  # _prepare_inputs calls in the current epoch
        self._round = 0  # index of the next round to train (global, across epochs)
        self._submitted: set[int] = set()  # round ids submitted (tracked on every rank)
        self._round_weights: dict[int, int] = {}  # round id -> round at which its weights were staged (main)
        self._buffered_inputs: list[dict] | None = None
        self._staged: tuple[int, dict] | None = None  # (policy version, state dict) on main
        self._staged_round = 0
        self._train_step_time = 0.0
        self._wait_in_step = 0.0  # part of the current training_step spent waiting for a round
        self._async_loader: AsyncDataLoaderWrapper | None = None
        self.generator: AsyncBatchGenerator | None = None
        self.backend = None
        self._backend_lock = threading.Lock()  # one generate/update sequence at a time (generator, evaluate)
        self._push_lock = threading.Lock()  # one weight push at a time

    def _bound_collectives(self) -> None:
        """Every collective (DDP all-reduce, the pipeline's gather/broadcast of rounds) waits at most `ddp_timeout`
        seconds for the other processes. transformers passes `ddp_timeout` to the process group on GPU only; on CPU
        (gloo) the group would keep torch's 30-minute default, so a stalled peer would hang the others that long."""
        dist = torch.distributed
        if self.accelerator.num_processes > 1 and dist.is_available() and dist.is_initialized():
            from datetime import timedelta

            from torch.distributed.distributed_c10d import _set_pg_timeout

            _set_pg_timeout(timedelta(seconds=self.args.ddp_timeout))

    # ------------------------------------------------------------------------------------------------------
    # construction-time checks
    # ------------------------------------------------------------------------------------------------------
    @staticmethod
    def _check_dataset(dataset, args: GRPOConfig, name: str, min_rows: int | None = None) -> None:
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

    @staticmethod
    def _make_environment(environment, tools, *datasets):
        from .envs import ToolEnv, check_environment

        if tools is not None:
            if environment is not None:
                raise ValueError("give either environment= or tools= (tools=[...] is environment=ToolEnv([...]))")
            environment = ToolEnv(tools)
        if environment is None:
            return None
        check_environment(environment)
        for ds in datasets:
            if ds is not None and len(ds) and not _is_conversational(ds[0]["prompt"]):
                raise ValueError(
                    "a multi-turn environment needs conversational prompts (lists of chat messages); the dataset's "
                    f"first prompt is {ds[0]['prompt']!r:.100}"
                )
        return environment

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
    def _ensure_generator(self) -> None:
        if not self.accelerator.is_main_process or self.generator is not None:
            return
        if self.backend is None:
            self.backend = self._make_backend()
        self.generator = AsyncBatchGenerator(
            self._generate_round,
            max_queue_size=self.args.async_max_queue_size,
            generation_timeout=self.args.async_generation_timeout,
        ).start()

    def _make_backend(self):
        from .generation import make_backend

        model = self.accelerator.unwrap_model(self.model)
        zero3_hf = self.args.generation_backend == "hf" and is_deepspeed_zero3_enabled()
        if zero3_hf:
            # ZeRO-3 partitions the policy (a forward needs every rank): generate on an unpartitioned twin of the
            # architecture instead; it receives whole weights (collected by every rank) before its first round
            from .generation import base_model

            base = base_model(model)
            model = type(base)(copy.deepcopy(base.config))
            model.generation_config = copy.deepcopy(base.generation_config)
        path = self._model_source
        if path is None and self.args.generation_backend == "vllm":
            path = self._save_sampler_model(model)
        backend = make_backend(self.args, model, self.processing_class, path)
        if zero3_hf:
            backend.version = -1  # the twin's weights are random: the first round must load the staged ones
        return backend

    def _save_sampler_model(self, model) -> str:
        """Write the architecture, current weights and tokenizer for an in-process engine that loads a folder (the
        `model` was given as an object). The trainer pushes its weights before every round anyway."""
        import tempfile

        from .generation import base_model

        base = base_model(model)
        folder = self._sampler_model_dir = tempfile.mkdtemp(prefix="grpo_async_sampler_")
        state = collect_state_dict(model)  # PEFT merged, HF names
        base.save_pretrained(folder, state_dict=state)
        self.processing_class.save_pretrained(folder)
        logger.info("saved the policy to %s for the in-process vLLM engine", folder)
        return folder

    def _sampling_config(self) -> SamplingConfig:
        a = self.args
        return SamplingConfig(
            n=a.num_generations,
            max_tokens=a.max_completion_length,
            temperature=a.temperature,
            top_p=a.top_p,
            top_k=a.top_k,
            min_p=a.min_p,
            stop=a.stop,
        )

    def _stage_weights(self) -> None:
        """At a sync point (round start, after an optimizer step): snapshot the weights for the generator.

        Every rank takes part (ZeRO-3 gathers); only the main process keeps the copy. Skipped when the policy
        version (optimizer step) has not changed since the last snapshot.
        """
        version = self.state.global_step
        if self._staged is not None and self._staged[0] == version:
            return
        state = collect_state_dict(self.accelerator.unwrap_model(self.model), self.accelerator.is_main_process)
        self._staged = (version, state) if self.accelerator.is_main_process else (version, {})
        self._staged_round = self._round
        if self.args.weight_sync_inflight and self.accelerator.is_main_process and self.backend is not None:
            # in-flight mode: the servers get the weights now, while the generator thread's round keeps running
            self._load_into_backend(self._staged)

    def _submit_rounds(self, generation_batch: list[dict]) -> None:
        """Submit the current round if needed and up to `num_batches_ahead` rounds after it."""
        todo = []
        if self._round not in self._submitted:
            todo.append((self._round, generation_batch))
        for j in range(1, self.args.num_batches_ahead + 1):
            if self._round + j in self._submitted:
                continue
            future = self._async_loader.batch_at(self._epoch_call + j * self.generate_every)
            if future is None:  # end of the epoch: that round is generated when its epoch starts
                break
            todo.append((self._round + j, future))
        if not todo:
            return
        self._stage_weights()
        for round_id, rows in todo:
            all_rows = gather_object(list(rows))  # every rank's rows, rank order
            self._submitted.add(round_id)
            if self.accelerator.is_main_process:
                self.generator.submit_batch(
                    BatchRequest(
                        batch_id=round_id,
                        prompts=[r["prompt"] for r in all_rows[:: self.num_generations]],
                        inputs=all_rows,
                        metadata={"weights": self._staged, "weights_round": self._staged_round},
                    )
                )

    def _next_round(self, generation_batch: list[dict]) -> list[dict]:
        self._ensure_generator()
        self._submit_rounds(generation_batch)
        round_id = self._round
        payload, err = None, None
        wait_start = time.perf_counter()
        if self.accelerator.is_main_process:
            try:
                result = self.generator.get_batch(round_id)
                payload = result.processed_results
                payload["generation_time"] = result.generation_time
            except Exception as e:  # tell the other ranks before raising, so they don't wait in the broadcast
                err = e
                payload = {"__error__": f"{type(e).__name__}: {e}"}
        wait_time = time.perf_counter() - wait_start
        self._wait_in_step += wait_time
        payload = broadcast_object_list([payload], from_process=0)[0]
        if err is not None:
            raise err
        if "__error__" in payload:
            raise RuntimeError(f"Async generation failed on the main process: {payload['__error__']}")
        self._submitted.discard(round_id)
        self._round += 1
        self._log_round_metrics(payload, wait_time)

        # keep this process's rows only
        total = payload["advantages"].size(0)
        local = select_rows(
            payload["rows"], process_slice(total, self.accelerator.num_processes, self.accelerator.process_index)
        )
        local["num_items_in_batch"] = payload["num_items_in_batch"]
        self._drop_stale(local)
        local = self._add_logps(local)
        local = shuffle_rows(local)
        return [trim_padding(b) for b in split_rows(local, self.args.steps_per_generation)]

    def _drop_stale(self, local: dict) -> None:
        """Never train a sample staler than `max_staleness` rounds: its loss mask is zeroed (counted, logged as
        `async/dropped_stale`). Staleness is measured in policy versions (optimizer steps) between the sample's
        weights and the weights this round starts training with; `max_staleness` rounds = that many rounds' steps."""
        steps_per_round = self.generate_every / self.args.gradient_accumulation_steps
        limit = math.ceil(self.args.max_staleness * steps_per_round - 1e-9)
        stale = (self.state.global_step - local["policy_version"]) > limit  # [L]
        local["loss_mask"][stale] = 0
        counts = torch.tensor([float(stale.sum()), float(local["loss_mask"].sum())], device=self.accelerator.device)
        dropped, items = self.accelerator.reduce(counts, reduction="sum").tolist()
        self._metrics["train"]["async/dropped_stale"].append(dropped)
        if dropped:
            local["num_items_in_batch"] = items  # the loss normaliser counts trained tokens only
            logger.warning(
                "round %d: %d samples older than max_staleness=%d rounds were not trained",
                self._round - 1,
                int(dropped),
                self.args.max_staleness,
            )

    @torch.no_grad()
    def _add_logps(self, local: dict) -> dict:
        """Old-policy logps (when the policy moves before the rows are trained) and reference logps (β > 0).

        Seed 000's aggregation on this process's rows: its training micro-batches are buffered until they hold
        `service_target_bs` rows (forced at the end of the round), then each stage runs over the buffered rows in
        chunks of its own micro-batch size, and the results are cut back at the micro-batch boundaries.
        """
        stages = {}
        if self.compute_old_logps:
            stages["old_logps"] = (self.args.old_logps_micro_batch_size, self._old_logps_fn)
        if self.args.beta > 0:
            stages["ref_logps"] = (self.args.ref_logps_micro_batch_size, self._ref_logps_fn)
        if not stages:
            return local
        T = local["completion_ids"].size(1)
        rows = {
            "ids": torch.cat([local["prompt_ids"], local["completion_ids"]], 1),  # [L, P+T]
            "mask": torch.cat([local["prompt_mask"], local["completion_mask"]], 1),  # [L, P+T]
        }
        buffer = MicroBatchBuffer(self.args.service_target_bs)
        micro = chunk_slices(num_rows(rows), self.args.per_device_train_batch_size)
        pieces: dict[str, list[torch.Tensor]] = {name: [] for name in stages}
        seconds, chunks = dict.fromkeys(stages, 0.0), dict.fromkeys(stages, 0)
        for i, sl in enumerate(micro):
            buffer.add(select_rows(rows, sl))
            taken = buffer.take(force=i == len(micro) - 1)
            if taken is None:
                continue
            merged, sizes = taken
            for name, (size, fn) in stages.items():
                t0 = time.perf_counter()
                logps, n = apply_in_chunks(lambda b, fn=fn: fn(b, T), merged, size)  # [B, T]
                pieces[name] += [p["logps"] for p in split_back({"logps": logps}, sizes)]
                seconds[name] += time.perf_counter() - t0
                chunks[name] += n
        m = self._metrics["train"]
        for name, parts in pieces.items():
            local[name] = torch.cat(parts)  # [L, T]
            m[f"timing/{name}"].append(seconds[name])  # per round, this process
            m[f"chunks/{name}"].append(float(chunks[name]))
        if self.args.importance_sampling_correction:
            self._add_importance_weights(local)
        return local

    def _add_importance_weights(self, local: dict) -> None:
        """`is_weights` = π_old / π_sampler per token or per completion (`importance_sampling_mode`), and metrics of
        the logp difference and the ratio over every process's tokens."""
        a = self.args
        mask = local["loss_mask"]  # [L, T]
        weights, diff = importance_sampling_weights(
            local["old_logps"],
            local["sampler_logps"],
            mask,
            a.importance_sampling_mode,
            a.importance_sampling_clip_min,
            a.importance_sampling_clip_max,
        )
        local["is_weights"] = weights  # [L, T] or [L, 1]
        on = mask.bool() if weights.size(1) > 1 else mask.any(1, keepdim=True)  # tokens / completions that count
        d, w = diff[mask.bool()].abs().float(), weights[on].float()
        empty = w.numel() == 0  # every token of this process's rows is masked
        stats = torch.tensor([d.sum(), d.numel(), d.max() if d.numel() else 0.0])
        ratios = torch.tensor([math.inf, 0.0, 0.0, -math.inf] if empty else [w.min(), w.sum(), w.numel(), w.max()])
        device = self.accelerator.device
        stats = self.accelerator.gather(stats.to(device)).view(-1, 3).cpu()  # [N, 3]
        ratios = self.accelerator.gather(ratios.to(device)).view(-1, 4).cpu()  # [N, 4]
        m = self._metrics["train"]
        m["sampling/logp_diff/mean"].append((stats[:, 0].sum() / stats[:, 1].sum().clamp(min=1)).item())
        m["sampling/logp_diff/max"].append(stats[:, 2].max().item())
        m["sampling/importance_sampling_ratio/min"].append(ratios[:, 0].min().item())
        m["sampling/importance_sampling_ratio/mean"].append((ratios[:, 1].sum() / ratios[:, 2].sum()).item())
        m["sampling/importance_sampling_ratio/max"].append(ratios[:, 3].max().item())

    def _old_logps_fn(self, batch: dict, T: int) -> torch.Tensor:
        device, a = self.accelerator.device, self.args
        ids, mask = batch["ids"].to(device), batch["mask"].to(device)
        return completion_logps(self.model, ids, mask, T, a.temperature, padding_free=a.padding_free).cpu()  # [b, T]

    def _ref_logps_fn(self, batch: dict, T: int) -> torch.Tensor:
        a = self.args
        if self.ref_client is not None:  # the frozen reference server
            return self.ref_client.completion_logps(batch["ids"], batch["mask"], T, a.temperature)  # [b, T]
        device = self.accelerator.device
        ids, mask = batch["ids"].to(device), batch["mask"].to(device)
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
        return {k: (v.to(self.accelerator.device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}

    # ------------------------------------------------------------------------------------------------------
    # generator thread (main process only)
    # ------------------------------------------------------------------------------------------------------
    def _tokenize_prompt(self, prompt) -> list[int]:
        tok = self.processing_class
        if _is_conversational(prompt):
            text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return tok(text, add_special_tokens=False)["input_ids"]
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
        return tok(prompt)["input_ids"]

    def _score(self, rows: list[dict], completions) -> torch.Tensor:
        """Decode completions (chat-formatted for chat prompts) and call the reward functions. Returns `[R, F]`."""
        completion_ids = [c.completion_ids for c in completions]
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        for c, t in zip(completions, texts):
            c.text = t
        prompts = [r["prompt"] for r in rows]
        formatted = [
            c.extra["messages"]  # multi-turn: the assistant's and the environment's messages
            if "messages" in c.extra
            else ([{"role": "assistant", "content": t}] if _is_conversational(p) else t)
            for p, t, c in zip(prompts, texts, completions, strict=True)
        ]
        columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
        columns["trainer_state"] = self.state  # as TRL: for reward shaping by training progress
        if completions and "state" in completions[0].extra:  # multi-turn: each rollout's final environment state
            columns["env_state"] = [c.extra["state"] for c in completions]
        return score_completions(
            self.reward_funcs,
            self.reward_func_names,
            prompts,
            formatted,
            completion_ids,
            columns,
            timeout=self.args.reward_timeout,
        )

    def _tokenize_prompts(self, prompts: list) -> tuple[list[list[int]], int]:
        """Token ids of each prompt, left-truncated to `max_prompt_length` (counted) or refused, as configured."""
        args = self.args
        out, truncated = [], 0
        for p in prompts:
            ids = self._tokenize_prompt(p)
            if args.max_prompt_length is not None and len(ids) > args.max_prompt_length:
                if args.prompt_truncation == "error":
                    raise ValueError(
                        f"a prompt has {len(ids)} tokens > max_prompt_length={args.max_prompt_length}: {p!r:.200}"
                    )
                ids, truncated = ids[-args.max_prompt_length :], truncated + 1
            out.append(ids)
        return out, truncated

    def _generate_with(self, prompt_ids: list[list[int]], weights: tuple[int, dict], n: int | None = None):
        """Load `weights` into the backend if it holds another version, then generate; atomic w.r.t. other callers
        (the generator thread and evaluate), so a round always runs on the weights it asked for."""
        G = self.num_generations if n is None else n
        size = self.args.rollout_micro_batch_size
        if size % G == 0:  # whole groups per call: prompts with n = G
            calls = [(prompt_ids[s], G) for s in chunk_slices(len(prompt_ids), size // G)]
        else:  # a chunk may cut a group: every prompt G times with n = 1
            rows = [p for p in prompt_ids for _ in range(G)]
            calls = [(rows[s], 1) for s in chunk_slices(len(rows), size)]
        sampling = self._sampling_config()
        with self._backend_lock:
            t_sync = self._load_into_backend(weights)
            completions = []
            for chunk, n_chunk in calls:
                sampling.n = n_chunk
                completions += self.backend.generate(chunk, sampling)
            return completions, t_sync, len(calls)

    def _generate_completions(self, prompts: list, rows: list[dict], prompt_ids, weights, n: int | None = None):
        """`_generate_with`, or multi-turn rollouts with the environment (`grpo_async.envs.rollout`) when there is
        one: `(completions, weight-sync seconds, generate calls)`; an env completion's `extra` holds its messages
        and `env_mask`."""
        if self.environment is None:
            return self._generate_with(prompt_ids, weights, n)
        from .envs import run_rollouts

        G = self.num_generations if n is None else n
        with self._backend_lock:
            t_sync = self._load_into_backend(weights)
            results = run_rollouts(
                self.backend,
                self.processing_class,
                self.environment,
                prompts,
                prompt_ids,
                rows,
                self._sampling_config(),
                G,
                self.args.max_completion_length,
            )
        return [r.to_completion() for r in results], t_sync, max(r.turns for r in results)

    def _load_into_backend(self, weights: tuple[int, dict]) -> float:
        """Push `weights` unless the backend already holds that version; returns the seconds it took. Callers hold
        `_backend_lock`, except the in-flight mode's push at the sync point, which must not wait for the round."""
        version, state = weights
        with self._push_lock:  # in-flight mode pushes from the trainer thread too
            if self.args.weight_sync_transport == "none" or getattr(self.backend, "version", None) == version:
                return 0.0
            t0 = time.perf_counter()
            self.backend.update_weights(state, version)
            return time.perf_counter() - t0

    def sync_weights(self) -> None:
        """Push the trainer's current weights to the sampler now (every rank must call; the generator thread's
        rounds are not disturbed: the push waits for the round in progress). Training does this by itself at each
        round boundary; call it to inspect the sampler between `train()` calls."""
        self._staged = None
        self._stage_weights()
        if self.accelerator.is_main_process:
            if self.backend is None:
                self.backend = self._make_backend()
            with self._backend_lock:
                self._load_into_backend(self._staged)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the generator thread and shut the generation backend down (an in-process vLLM engine frees its
        memory). The trainer can still `train()` again: a new backend is built then. A generator thread still stuck
        after `timeout` seconds (e.g. in a weight push to a dead server) is a daemon: the backend is then left to
        the process's exit rather than closed under its feet."""
        generator = self.generator
        self.close_generator(timeout)
        if generator is not None and generator.is_running():
            logger.warning("generator thread still busy after %.0fs; the generation backend is left open", timeout)
            self.backend = None
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        if getattr(self, "_sampler_model_dir", None):
            import shutil

            shutil.rmtree(self._sampler_model_dir, ignore_errors=True)
            self._sampler_model_dir = None

    def _generate_round(self, request: BatchRequest) -> dict[str, Any]:
        """Runs in the generator thread: weights → generate → rewards → advantages → padded tensors."""
        args, G = self.args, self.num_generations
        version, state = request.metadata["weights"]
        rows = request.inputs
        for g in range(0, len(rows), G):
            if any(rows[g + i]["prompt"] != rows[g]["prompt"] for i in range(G)):
                raise RuntimeError(f"round {request.batch_id}: rows {g}..{g + G - 1} are not {G} copies of a prompt")
        prompt_ids, truncated = self._tokenize_prompts(request.prompts)
        t0 = time.perf_counter()
        completions, t_sync, rollout_chunks = self._generate_completions(
            request.prompts, rows, prompt_ids, (version, state)
        )
        if args.weight_sync_transport == "none":
            version = 0  # the sampler keeps the initial weights
        t_gen = time.perf_counter() - t0 - t_sync

        tok = self.processing_class
        completion_ids = [c.completion_ids for c in completions]
        t0 = time.perf_counter()
        rewards_per_func = self._score(rows, completions)  # [R, F]
        t_reward = time.perf_counter() - t0
        rewards = combine_rewards(rewards_per_func, self.reward_weights)  # [R]
        advantages = compute_advantages(rewards, G, args.scale_rewards)  # [R]

        R = len(rows)
        prompt_rep_ids = [prompt_ids[i // G] for i in range(R)]
        completion_mask = pad([[1] * len(c) for c in completion_ids], 0)  # [R, T] tokens that exist
        truncated_rows = torch.tensor([c.finish_reason == "length" for c in completions])  # [R]
        loss_mask = completion_mask.clone()  # [R, T] tokens trained on
        if self.environment is not None and args.mask_env_responses:  # environment/tool tokens are not trained
            loss_mask *= pad([c.extra["env_mask"] for c in completions], 0)  # [R, T]
        if args.mask_truncated_completions:
            loss_mask[truncated_rows] = 0
        lengths = completion_mask.sum(1).float()
        metrics = {
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated_rows.float().mean().item(),
            "reward": torch.nanmean(rewards).item(),
            "reward_std": nanstd(rewards).item(),
            "frac_reward_zero_std": group_std_is_zero(rewards, G).float().mean().item(),
            "prompts/truncated": float(truncated),
            "timing/rollout": t_gen,
            "timing/weight_sync": t_sync,
            "chunks/rollout": float(rollout_chunks),
            "timing/rewards": t_reward,
        }
        if self.environment is not None:  # multi-turn: assistant turns, environment tokens, rollouts cut by max_turns
            turns = torch.tensor([float(c.extra["turns"]) for c in completions])  # [R]
            env_tokens = sum(len(c.extra["env_mask"]) - sum(c.extra["env_mask"]) for c in completions)
            metrics["env/turns/mean"] = turns.mean().item()
            metrics["env/turns/max"] = turns.max().item()
            metrics["env/env_tokens_frac"] = env_tokens / max(1.0, completion_mask.sum().item())
            metrics["env/max_turns_ratio"] = sum(c.finish_reason == "max_turns" for c in completions) / R
        for i, name in enumerate(self.reward_func_names):
            metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
            metrics[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
        return {
            "rows": {
                "prompt_ids": pad(prompt_rep_ids, tok.pad_token_id, side="left"),  # [R, P]
                "prompt_mask": pad([[1] * len(p) for p in prompt_rep_ids], 0, side="left"),  # [R, P]
                "completion_ids": pad(completion_ids, tok.pad_token_id),  # [R, T]
                "completion_mask": completion_mask,  # [R, T]
                "loss_mask": loss_mask,  # [R, T]
                "sampler_logps": pad([c.logprobs for c in completions], 0.0, dtype=torch.float32),  # [R, T]
                "advantages": advantages,  # [R]
                "policy_version": torch.full((R,), version, dtype=torch.long),  # [R]
                "weights_round": torch.full((R,), request.metadata["weights_round"], dtype=torch.long),  # [R]
                "round_id": torch.full((R,), request.batch_id, dtype=torch.long),  # [R]
                "row_index": torch.arange(R),  # [R] position in the global round
            },
            "advantages": advantages,
            "num_items_in_batch": loss_mask.sum().item(),
            "metrics": metrics,
            "samples": {
                "prompt": [r["prompt"] for r in rows],
                "completion": [c.text for c in completions],
                "rewards": {name: rewards_per_func[:, i].tolist() for i, name in enumerate(self.reward_func_names)},
                "reward": rewards.tolist(),
                "advantage": advantages.tolist(),
                "policy_version": [version] * R,
                "round": request.batch_id,
            },
        }

    # ------------------------------------------------------------------------------------------------------
    # loss
    # ------------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss does not return outputs")
        args = self.args
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # [B, P+T]
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # [B, P+T]
        T = inputs["completion_ids"].size(1)
        logps = completion_logps(model, ids, attention_mask, T, args.temperature, padding_free=args.padding_free)
        mask = inputs["loss_mask"]  # [B, T]
        out = grpo_loss(
            logps,
            inputs["advantages"],
            mask,
            loss_type=args.loss_type,
            old_per_token_logps=inputs.get("old_logps"),
            ref_per_token_logps=inputs.get("ref_logps"),
            beta=args.beta,
            epsilon_low=args.epsilon,
            epsilon_high=args.epsilon_high,
            importance_weights=inputs.get("is_weights"),
            ctx=LossContext(
                grad_accum_steps=self.current_gradient_accumulation_steps,
                max_completion_length=args.max_completion_length,
                num_items_in_batch=inputs["num_items_in_batch"],
                num_processes=self.accelerator.num_processes,
                steps_per_generation=args.steps_per_generation,
            ),
        )
        self._log_loss_metrics(out, mask, inputs)
        return out.loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        start = time.perf_counter()
        self._wait_in_step = 0.0
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        except RuntimeError as e:
            if self.accelerator.num_processes > 1 and _is_peer_failure(e):
                raise RuntimeError(
                    f"process {self.accelerator.process_index} of {self.accelerator.num_processes}: a collective with "
                    f"the other training processes failed at micro-step {self._step} (global step "
                    f"{self.state.global_step}): a peer process died, or did not answer within "
                    f"ddp_timeout={self.args.ddp_timeout}s; see the other processes' logs for the first error "
                    f"({type(e).__name__}: {str(e)[:300]})"
                ) from e
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
    def _global_masked_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        totals = self.accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum()]).float(), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def _log_loss_metrics(self, out, mask, inputs) -> None:
        m = self._metrics["train"]
        mask = mask.float()
        if out.per_token_kl is not None:
            m["kl"].append(self._global_masked_mean(out.per_token_kl.detach(), mask))
        low, high = out.is_low_clipped.float(), out.is_high_clipped.float()
        m["clip_ratio/low_mean"].append(self._global_masked_mean(low, mask))
        m["clip_ratio/high_mean"].append(self._global_masked_mean(high, mask))
        m["clip_ratio/region_mean"].append(self._global_masked_mean(torch.maximum(low, high), mask))
        staleness = (self._round - 1 - inputs["weights_round"]).float()  # [B] rounds
        stats = self.accelerator.gather(staleness)
        m["async/staleness"].append(stats.mean().item())
        m["async/staleness_max"].append(stats.max().item())
        m["async/staleness_min"].append(stats.min().item())
        steps = self.accelerator.gather((self.state.global_step - inputs["policy_version"]).float())
        m["async/staleness_steps"].append(steps.mean().item())

    def _log_round_metrics(self, payload: dict, wait_time: float) -> None:
        m = self._metrics["train"]
        for k, v in payload["metrics"].items():
            m[k].append(v)
        m["timing/generation"].append(payload["generation_time"])
        m["timing/wait_generation"].append(wait_time)
        if self.generator is not None:
            m["async/pending"].append(float(self.generator.get_pending_count()))
            m["async/completed"].append(float(self.generator.get_completed_count()))
        self._last_samples = payload.get("samples")

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = {k: sum(v) / len(v) for k, v in self._metrics[mode].items() if v}
        if mode == "eval":
            metrics = {f"eval_{k}": v for k, v in metrics.items()}
        for key, values in self._metrics[mode].items():  # extremes over the logging window, not their mean
            name = f"eval_{key}" if mode == "eval" else key
            if values and (key.endswith(("/max", "_max")) or key == "async/pending"):
                metrics[name] = max(values)
            elif values and key.endswith(("/min", "_min")):
                metrics[name] = min(values)
        logs = {**logs, **{k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}}
        super().log(logs, start_time)
        self._metrics[mode].clear()
        if self.args.log_completions and self.accelerator.is_main_process and getattr(self, "_last_samples", None):
            self._print_completions(self._last_samples)
            self._last_samples = None  # each round's samples are logged once

    def _print_completions(self, samples: dict) -> None:
        """The round's completions table: a rich table on the console, every sample to a parquet file."""
        log_completions(samples, self.args.output_dir, self.state.global_step, self.args.num_completions_to_print)

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
        Runs beside the training pipeline without touching its queue or its policy-version bookkeeping: the
        generator thread reloads its own round's weights if evaluation left others in the backend.
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
        # every rank takes part in collecting the weights (ZeRO-3); the main process generates and scores
        weights = (
            -1 - self.state.global_step,  # a version no training round uses
            collect_state_dict(self.accelerator.unwrap_model(self.model), self.accelerator.is_main_process),
        )
        metrics = None
        if self.accelerator.is_main_process:
            if self.backend is None:
                self.backend = self._make_backend()
            G = self.num_generations
            chunk = max(1, self.args.generation_batch_size // G)
            rewards_all, per_func_all, lengths = [], [], []
            for lo in range(0, len(dataset), chunk):
                rows = [dataset[i] for i in range(lo, min(lo + chunk, len(dataset)))]
                prompt_ids, _ = self._tokenize_prompts([r["prompt"] for r in rows])
                rows_rep = [r for r in rows for _ in range(G)]
                prompts = [r["prompt"] for r in rows]
                completions, _, _ = self._generate_completions(prompts, rows_rep, prompt_ids, weights, G)
                per_func = self._score(rows_rep, completions)  # [n·G, F]
                per_func_all.append(per_func)
                rewards_all.append(combine_rewards(per_func, self.reward_weights))
                lengths += [len(c.completion_ids) for c in completions]
            rewards, per_func = torch.cat(rewards_all), torch.cat(per_func_all)
            metrics = {
                "reward": torch.nanmean(rewards).item(),
                "reward_std": nanstd(rewards).item(),
                "completions/mean_length": sum(lengths) / len(lengths),
                **{f"rewards/{n}": torch.nanmean(per_func[:, i]).item() for i, n in enumerate(self.reward_func_names)},
                "runtime": time.perf_counter() - start,
            }
        metrics = broadcast_object_list([metrics], from_process=0)[0]
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        metrics["epoch"] = self.state.epoch
        Trainer.log(self, metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ------------------------------------------------------------------------------------------------------
    # lifecycle
    # ------------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`; resuming also restores the pipeline (see `PIPELINE_STATE_FILE`): the run continues with
        exactly the prompts an uninterrupted run would have trained (rounds that were generated ahead but not
        trained at the checkpoint are generated again, from the checkpoint's weights)."""
        if resume_from_checkpoint:
            path = resume_from_checkpoint
            if path is True:
                from transformers.trainer_utils import get_last_checkpoint

                path = get_last_checkpoint(self.args.output_dir)
                if path is None:
                    raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir} has no checkpoint")
            self._load_pipeline_state(path)
            resume_from_checkpoint = path
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except KeyboardInterrupt:
            # Ctrl-C: stop the generator thread without waiting out a round, shut the backend down, re-raise
            logger.warning("interrupted: stopping the generator thread and the generation backend")
            self.close(timeout=2.0)
            raise
        finally:
            self.close_generator()

    # ------------------------------------------------------------------------------------------------------
    # checkpoints: what the pipeline needs to resume exactly
    # ------------------------------------------------------------------------------------------------------
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
        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, SAVING_DIR) if self._saving_into_staging else run_dir

    def _save_checkpoint(self, model, trial):
        """Atomic: every process writes into `output_dir/_grpo_async_saving/checkpoint-N`, then the main process
        renames the finished folder to `output_dir/checkpoint-N` and only then rotates old checkpoints. A process
        killed mid-save leaves the previous checkpoints untouched, and `get_last_checkpoint` never sees a partial
        one (it only lists `checkpoint-<n>` folders). Not with `push_to_hub` and `hub_strategy` "checkpoint" /
        "all_checkpoints": the Trainer uploads the checkpoint folder in the background by its path, so it is written
        in place (the pipeline state last) as the Trainer does."""
        import shutil

        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        strategy = getattr(self.args.hub_strategy, "value", self.args.hub_strategy)
        if self.args.push_to_hub and strategy in ("checkpoint", "all_checkpoints"):
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                self._write_pipeline_state(os.path.join(run_dir, name))
            return
        staged, final = os.path.join(run_dir, SAVING_DIR, name), os.path.join(run_dir, name)
        if self.args.should_save and os.path.exists(staged):  # left by a save that was killed
            shutil.rmtree(staged)
        self.accelerator.wait_for_everyone()
        self._saving_into_staging = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_into_staging = False
        staging_root = os.path.join(run_dir, SAVING_DIR)
        best = self.state.best_model_checkpoint
        if best and os.path.dirname(os.path.abspath(best)) == os.path.abspath(staging_root):
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))  # where it will be
            if self.args.should_save:
                from transformers.trainer import TRAINER_STATE_NAME

                self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        if self.args.should_save:
            self._write_pipeline_state(staged)
        self.accelerator.wait_for_everyone()  # every process's files (rng states, shards) are in `staged`
        if self.args.should_save:
            if os.path.exists(final):  # the same step saved again (after a resume): swap, then drop the old one
                old = os.path.join(run_dir, SAVING_DIR, name + ".old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(staged, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(staged, final)
            from transformers.trainer_utils import rotate_checkpoints

            # old checkpoints are deleted only now that the new one is complete (Trainer's own rotation ran in the
            # staging folder, where there is nothing else to delete)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
            try:
                os.rmdir(staging_root)  # only when empty
            except OSError:
                pass
        self.accelerator.wait_for_everyone()

    def _write_pipeline_state(self, folder: str) -> None:
        tmp = os.path.join(folder, PIPELINE_STATE_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self._pipeline_state(), f, indent=1)
        os.replace(tmp, os.path.join(folder, PIPELINE_STATE_FILE))

    def _load_pipeline_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, PIPELINE_STATE_FILE)
        if not os.path.exists(path):
            raise ValueError(
                f"{checkpoint} has no {PIPELINE_STATE_FILE}: it was not written by grpo_async's GRPOTrainer, so the "
                "pipeline position (rounds, micro-steps) cannot be restored"
            )
        with open(path) as f:
            saved = json.load(f)
        now = self._pipeline_state()["geometry"]
        diff = {k: (v, now[k]) for k, v in saved["geometry"].items() if now.get(k) != v}
        if diff:
            changed = ", ".join(f"{k}: {a} → {b}" for k, (a, b) in diff.items())
            raise ValueError(
                f"cannot resume from {checkpoint}: the batch geometry changed ({changed}); "
                "prompts would be skipped or trained twice. Resume with the settings the checkpoint was written with."
            )
        self._step, self._round = saved["micro_steps"], saved["round"]
        if saved["submitted_rounds"]:
            logger.info(
                "resuming at round %d: rounds %s were generated ahead of the checkpoint and are generated again",
                self._round,
                saved["submitted_rounds"],
            )

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

    def close_generator(self, timeout: float = 10.0) -> None:
        """Stop the generator thread (rounds still queued are abandoned; the round in progress gets `timeout`
        seconds to finish); the backend stays for a later train()."""
        if self.generator is not None:
            self.generator.stop(timeout)
            self.generator = None
        self._submitted.clear()
        self._buffered_inputs = None
        self._staged = None
