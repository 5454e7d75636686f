"""TRL 1.16's experimental `AsyncGRPOConfig` / `AsyncGRPOTrainer`, on this trainer: a TRL script ports by changing
the import (`from grpo_async import AsyncGRPOConfig, AsyncGRPOTrainer`).

TRL's async trainer always generates on a vLLM server, streaming prompt groups while it trains. Here that is
`generation_backend="vllm_server"` (a `grpo-async serve` or a stock `vllm serve`; the backend tells which) with
`async_mode="stream"`. Each TRL field either maps onto ours or, where this trainer cannot do what TRL's does, is
accepted at TRL's default only (any other value: [`RefusedField`], a `ValueError` naming the field):

```txt
TRL AsyncGRPOConfig                      here
vllm_server_base_url                 →   the server (generation_backend='vllm_server', async_mode='stream')
vllm_server_timeout                  →   AsyncGRPOTrainer.train() waits that long for GET /health
request_timeout                      →   every HTTP request's timeout (GRPOConfig.vllm_server_timeout on trainer.args)
max_staleness (4)                    →   max_staleness (staleness_policy='pace': stale rows are not generated)
max_inflight_tasks (-1: auto)        →   max_inflight_groups = ceil(tasks / num_generations)
weight_sync_steps                    →   steps_per_generation (weights are published at each round boundary)
token_budget (None / <= 0 / n)       →   token_budget (None: off / None / n)
dtype                                →   model_init_kwargs['dtype'] when the model is loaded by name
weight_sync_timeout, queue_maxsize,
heartbeat_stale_after_s,
fork_threshold_tokens                →   TRL's default only (RefusedField otherwise; each message says what to use)
```
`docs/trl_compatibility.md` ("Porting from TRL's AsyncGRPOTrainer") has the table of every field.
"""

import dataclasses
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from transformers.trainer_utils import SchedulerType

from .config import GRPOConfig
from .config.checks import Number, OneOf, checked_field
from .config.derived import derived, given, is_derived
from .generation import registered_backends
from .trainer import GRPOTrainer

logger = logging.getLogger(__name__)

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "RefusedField"]

#: TRL's default server
TRL_SERVER_URL = "http://localhost:8000"
#: TRL AsyncGRPOConfig fields accepted only at TRL's default: field → (default, why, what to use instead)
ONLY_AT_TRL_DEFAULT = {
    "weight_sync_timeout": (
        1800,
        "a weight push here is bounded per HTTP request by request_timeout (one timeout for every request to the "
        "server, generation or weight push)",
        "raise request_timeout for a push that takes longer",
    ),
    "queue_maxsize": (
        1024,
        "there is no separate queue of scored samples: a finished prompt group waits in the round it is assembled "
        "into, and how far generation runs ahead is bounded by max_inflight_tasks (max_inflight_groups here) and "
        "max_staleness",
        "bound it with max_inflight_tasks",
    ),
    "heartbeat_stale_after_s": (
        300.0,
        "generation runs in threads of the trainer process, not a child process with a heartbeat: a failure there "
        "is raised in the trainer at once",
        "bound a hang with async_generation_timeout (seconds any wait on the generator may last)",
    ),
    "fork_threshold_tokens": (
        1024,
        "multi-turn rollouts are never forked into several rows: a chat template that rewrites earlier turns is "
        "refused (ChatTemplatePrefixError), so there is no drift to measure",
        "leave it at 1024",
    ),
}


class RefusedField(ValueError, NotImplementedError):
    """A TRL `AsyncGRPOConfig` field at a value this trainer cannot honour. A `ValueError` (and, like the TRL
    `GRPOConfig` options `GRPOConfig` refuses, a `NotImplementedError`); the message names the field."""


def _refused(name: str, value: Any, why: str) -> RefusedField:
    return RefusedField(f"AsyncGRPOConfig.{name}={value!r}: {why}")


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    r"""Configuration of [`AsyncGRPOTrainer`]: TRL 1.16's `trl.experimental.async_grpo.AsyncGRPOConfig` on
    [`GRPOConfig`]. Every field of TRL's class is accepted with TRL's default and meaning, or refused at any other
    value (`RefusedField`, see `ONLY_AT_TRL_DEFAULT`); every `GRPOConfig` field works as well.

    TRL's defaults: generation on the vLLM server at `vllm_server_base_url` (`"http://localhost:8000"` unless
    `vllm_server_urls` names the servers), streamed (`async_mode="stream"`), `max_staleness=4`,
    `max_completion_length=2048`, prompts kept whole (`max_prompt_length=None`), `logging_steps=1`,
    `lr_scheduler_type="constant"`, `num_completions_to_print=None`. `GRPOConfig`'s own defaults are kept for
    `bf16` (False), `gradient_checkpointing` (False), `ignore_data_skip` (False: a resumed run replays exactly) and
    `remove_unused_columns` (False: the columns reach the reward functions, as they do in TRL's rollout worker).
    """

    # ---- TrainingArguments defaults of TRL's AsyncGRPOConfig ------------------------------------------------------
    logging_steps: float = field(default=1, metadata={"help": "Log every X optimizer steps (TRL async: 1)."})
    lr_scheduler_type: SchedulerType | str = field(
        default="constant",
        metadata={"help": "Learning-rate schedule (TRL async: 'constant'). A decaying one needs max_steps."},
    )

    # ---- the model ----------------------------------------------------------------------------------------------
    dtype: str = checked_field(
        OneOf(("auto", "bfloat16", "float16", "float32")),
        default="float32",
        metadata={
            "help": "TRL: dtype the model is loaded in when given by name (model_init_kwargs['dtype'] takes "
            "precedence); serve the model in the same dtype (--dtype). Ignored, with a warning, for a model object."
        },
    )

    # ---- generation (TRL's defaults on GRPOConfig fields) ---------------------------------------------------------
    max_completion_length: int | None = checked_field(
        Number(gt=0, integer=True),
        default=2048,
        metadata={"help": "Most tokens generated per completion (TRL: 2048)."},
    )
    max_prompt_length: int | None = checked_field(
        Number(gt=0, integer=True, optional=True),
        default=None,
        metadata={"help": "TRL async keeps prompts whole (None); an int truncates them from the left."},
    )
    num_completions_to_print: int | None = checked_field(
        Number(ge=0, integer=True, optional=True, what="an int >= 0 or None (all)"),
        default=None,
        metadata={"help": "Completions printed per log; None (TRL) prints all of them."},
    )
    fork_threshold_tokens: int = checked_field(
        Number(ge=0, integer=True),
        default=1024,
        metadata={"help": "TRL field; multi-turn rollouts are never forked here: only 1024 is accepted."},
    )

    # ---- the vLLM server --------------------------------------------------------------------------------------------
    generation_backend: str | None = checked_field(
        OneOf(registered_backends, optional=True, hint=" (add others with grpo_async.generation.register_backend)"),
        default="vllm_server",
        metadata={"help": "TRL's async trainer generates on a vLLM server: 'vllm_server' (any registered backend)."},
    )
    vllm_server_timeout: float = checked_field(
        Number(gt=0),
        default=240.0,
        metadata={
            "help": "TRL: seconds AsyncGRPOTrainer.train() waits for the server(s) to answer GET /health before "
            "raising TimeoutError. The per-request timeout is request_timeout."
        },
    )
    request_timeout: float = checked_field(
        Number(gt=0),
        default=600,
        metadata={
            "help": "TRL: seconds any HTTP request to the server (generation or weight push) may take; the trainer's "
            "copy of the config (trainer.args) holds it as vllm_server_timeout, which the server backend reads."
        },
    )
    weight_sync_timeout: float = checked_field(
        Number(gt=0),
        default=1800,
        metadata={"help": "TRL field; pushes are bounded per request by request_timeout: only 1800 is accepted."},
    )

    # ---- training ---------------------------------------------------------------------------------------------------
    token_budget: int | None = checked_field(
        Number(integer=True, optional=True, what="an int or None"),
        default=None,
        metadata={
            "help": "TRL async: token positions per forward pass, per device (GRPOConfig.token_budget). None "
            "(TRL: the server's max_model_len) and <= 0 (TRL: off) both mean off here: rows as the micro-batch "
            "sizes say (same gradients; only the memory bound differs).",
        },
    )

    # ---- the async pipeline -----------------------------------------------------------------------------------------
    async_mode: Literal["rounds", "stream"] = field(
        default="stream",
        metadata={"help": "'stream' (TRL async): prompt groups generate concurrently, rounds take the first ready."},
    )
    max_inflight_tasks: int = checked_field(
        Number(integer=True, what="an int (< 0: auto)"),
        default=-1,
        metadata={
            "help": "TRL: most completions generating at once; here max_inflight_groups = ceil(max_inflight_tasks / "
            "num_generations) (whole groups). < 0 (auto): max(max_staleness, 1) × per_device_train_batch_size × "
            "gradient_accumulation_steps × processes, as TRL. 0 is refused (nothing would generate)."
        },
    )
    max_staleness: int | None = checked_field(
        Number(ge=0, integer=True, optional=True, what="an int >= 0 (policy versions, i.e. optimizer steps) or None"),
        default=4,
        metadata={
            "help": "TRL: most optimizer steps a trained sample may lag the policy (4). Here with staleness_policy "
            "'pace' (default): rows that would be staler are not generated (the generator waits for new weights); "
            "'drop' generates them and discards them at training time, as TRL does. None: no limit."
        },
    )
    queue_maxsize: int = checked_field(
        Number(ge=0, integer=True),
        default=1024,
        metadata={"help": "TRL field; no separate sample queue here (see max_inflight_tasks): only 1024 is accepted."},
    )
    weight_sync_steps: int = checked_field(
        Number(ge=1, integer=True),
        default=1,
        metadata={
            "help": "TRL: optimizer steps between weight syncs. Weights are published at each round boundary, so N > "
            "1 makes a round N steps (steps_per_generation = N × gradient_accumulation_steps / num_iterations); 1 "
            "leaves the round to steps_per_generation / generation_batch_size."
        },
    )
    heartbeat_stale_after_s: float = checked_field(
        Number(gt=0),
        default=300.0,
        metadata={
            "help": "TRL field; no rollout child process here: only 300.0 is accepted (async_generation_timeout)."
        },
    )

    def __post_init__(self):
        for name, (default, why, instead) in ONLY_AT_TRL_DEFAULT.items():
            value = getattr(self, name)
            if value != default:
                raise _refused(name, value, f"{why}; {instead}")
        if isinstance(self.max_inflight_tasks, int) and self.max_inflight_tasks == 0:
            raise _refused("max_inflight_tasks", 0, "nothing would generate; give a count > 0, or < 0 for TRL's auto")
        budget = self.token_budget
        if isinstance(budget, int) and not isinstance(budget, bool) and budget <= 0:
            self.token_budget = None  # TRL: <= 0 disables token budgeting
        if given(self.vllm_server_base_url) is None:  # TRL's default server, unless ours name the servers
            default_server = (
                self.generation_backend == "vllm_server"
                and not self.vllm_server_urls
                and (self.vllm_server_host, self.vllm_server_port) == ("0.0.0.0", 8000)
            )
            self.vllm_server_base_url = derived(TRL_SERVER_URL) if default_server else None
        super().__post_init__()

    def _check_unsupported(self) -> None:
        """`GRPOConfig`'s refusals of TRL options (e.g. `use_liger_kernel=True`, which TRL's async trainer refuses
        too), raised as `RefusedField` (a `ValueError` and a `NotImplementedError`)."""
        try:
            super()._check_unsupported()
        except NotImplementedError as e:
            if isinstance(e, ValueError):
                raise
            raise RefusedField(str(e).replace("GRPOConfig.", "AsyncGRPOConfig.", 1)) from e

    def _derive(self) -> None:
        """`GRPOConfig._derive`, with the round set by `weight_sync_steps` and `max_inflight_groups` (and the queue
        that holds its rounds) from `max_inflight_tasks`, all marked as derived."""
        n, ga, mu = self.weight_sync_steps, self.gradient_accumulation_steps, self.num_iterations
        round_given = given(self.generation_batch_size) is not None or given(self.steps_per_generation) is not None
        set_round = n != 1 and not round_given
        if set_round:
            if (n * ga) % mu:
                raise _refused(
                    "weight_sync_steps",
                    n,
                    f"a round of {n} optimizer steps is {n} × gradient_accumulation_steps={ga} micro-steps, not a "
                    f"multiple of num_iterations={mu}",
                )
            self.steps_per_generation = n * ga // mu  # taken as given by GRPOConfig._derive, marked derived below
        super()._derive()
        if set_round:
            self.steps_per_generation = derived(self.steps_per_generation)
        if n != 1 and self.steps_per_round != n:
            raise _refused(
                "weight_sync_steps",
                n,
                f"weights are published once per round, and the round set by steps_per_generation="
                f"{self.steps_per_generation} / generation_batch_size={self.generation_batch_size} is "
                f"{self.steps_per_round:g} optimizer steps; leave those two unset (weight_sync_steps sets them) or "
                "set weight_sync_steps=1",
            )
        tasks, auto = self.max_inflight_tasks, self.max_inflight_tasks < 0
        if auto:  # TRL: what can be trained before it goes stale, at least one step's samples
            per_step = self.per_device_train_batch_size * ga * self.world_size
            tasks = max(self.max_staleness or 0, 1) * per_step
        groups = max(1, -(-tasks // self.num_generations))
        if is_derived(self, "max_inflight_groups"):
            self.max_inflight_groups = derived(groups)
            if is_derived(self, "async_max_queue_size"):
                self.async_max_queue_size = derived(self.rounds_ahead + 2)
        elif not auto and self.max_inflight_groups != groups:
            raise _refused(
                "max_inflight_tasks",
                self.max_inflight_tasks,
                f"it means {groups} prompt groups of num_generations={self.num_generations}, but max_inflight_groups="
                f"{self.max_inflight_groups} is set too; set only one of the two",
            )


class AsyncGRPOTrainer(GRPOTrainer):
    """TRL 1.16's `trl.experimental.async_grpo.AsyncGRPOTrainer`, with TRL's constructor, on [`GRPOTrainer`].

    Generation streams from the vLLM server(s) of `args` (a `grpo-async serve` or a stock `vllm serve`) while the
    policy trains; the weights reach the server at each round boundary (every `weight_sync_steps` optimizer steps).

    Args:
        model (`str` or `PreTrainedModel`): a model id or folder (loaded in `args.dtype`, as TRL), or a model.
        reward_funcs, train_dataset, processing_class, callbacks, optimizers, peft_config, tools,
            environment_factory: as TRL's (and `GRPOTrainer`'s). Reward functions run in this process (threads), so
            they need not be picklable.
        args (`AsyncGRPOConfig`, *optional*): default `AsyncGRPOConfig("<model name>-AsyncGRPO")`, as TRL. The
            trainer works on a copy (`trainer.args`) whose `vllm_server_timeout` is `request_timeout` (the
            per-request timeout the server backend reads) and whose `model_init_kwargs` carries `dtype`.
        rollout_worker, weight_transfer: TRL's plug-in protocols; not supported (`NotImplementedError` saying what
            to use instead).
    """

    _tag_names = ["trl", "async-grpo", "grpo_async"]

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: AsyncGRPOConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        environment_factory=None,
        rollout_worker=None,
        weight_transfer=None,
    ):
        if rollout_worker is not None:
            raise NotImplementedError(
                "AsyncGRPOTrainer(rollout_worker=...) is not supported: generation and scoring run in this trainer's "
                "pipeline, not in a worker object. Plug in another generator as a generation backend "
                "(grpo_async.generation.register_backend(name, factory, streams=True), then "
                "AsyncGRPOConfig(generation_backend=name)), or replace generation per call with GRPOTrainer's "
                "rollout_func."
            )
        if weight_transfer is not None:
            raise NotImplementedError(
                "AsyncGRPOTrainer(weight_transfer=...) is not supported: weights reach the sampler through the "
                "generation backend. Choose how with AsyncGRPOConfig(weight_sync_transport=...) ('auto', 'broadcast', "
                "'ipc', or 'none' to disable trainer-side weight sync), or register a backend whose load_weights does "
                "the transfer (grpo_async.generation.register_backend)."
            )
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = AsyncGRPOConfig(output_dir=f"{str(name).split('/')[-1]}-AsyncGRPO")
        if not isinstance(args, AsyncGRPOConfig):
            raise TypeError(f"args must be a grpo_async.AsyncGRPOConfig, got {type(args).__name__}")
        self.server_ready_timeout = float(args.vllm_server_timeout)  # TRL's vllm_server_timeout: see train()
        super().__init__(
            model,
            reward_funcs,
            args=_trainer_args(args, model),
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            tools=tools,
            environment_factory=environment_factory,
        )

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`GRPOTrainer.train`, after waiting (main process) up to TRL's `vllm_server_timeout` seconds for the
        vLLM server(s) to answer `GET /health`, as TRL's trainer does before its first weight sync."""
        if self.accelerator.is_main_process and self.backend is None:
            self.wait_for_servers()
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def wait_for_servers(self, poll_interval_s: float = 2.0) -> None:
        """Block until every server of `args.server_urls` answers `GET /health` with 200 (vllm_server backend only),
        or raise `TimeoutError` after `vllm_server_timeout` (the one `args` was given with) seconds."""
        from .net import health_problem, probe_health

        if self.args.generation_backend != "vllm_server":
            return
        start = time.monotonic()
        for url in self.args.server_urls:
            url = str(url).rstrip("/")
            while (error := probe_health(url, self.args.vllm_api_key, timeout=5.0)) is not None:
                waited = time.monotonic() - start
                problem = health_problem(url, error)  # nothing answered, or something answered with an error
                if waited >= self.server_ready_timeout:
                    hint = (
                        "Start it (grpo-async serve MODEL, or vllm serve), or if it is still loading the model, raise "
                        "vllm_server_timeout in your AsyncGRPOConfig."
                        if not error.answered
                        else "Check vllm_server_base_url (host and port) and the server's log."
                    )
                    raise TimeoutError(
                        f"Timed out after {waited:.0f}s waiting for the vLLM server at {url} (GET /health): "
                        f"{problem}. {hint}"
                    )
                logger.info("waiting for the vLLM server at %s (%.0fs): %s", url, waited, problem)
                time.sleep(poll_interval_s)


def _trainer_args(args: AsyncGRPOConfig, model) -> AsyncGRPOConfig:
    """The trainer's copy of `args`: `vllm_server_timeout` = `request_timeout` (what our server backend reads as
    the per-request timeout), and, for a model loaded by name, `dtype` and `trust_remote_code` set by default in
    `model_init_kwargs`, as TRL's trainer writes them into its args."""
    changes: dict[str, Any] = {"vllm_server_timeout": float(args.request_timeout)}
    if isinstance(model, str):
        kwargs = dict(args.model_init_kwargs or {})
        if "torch_dtype" not in kwargs:
            kwargs.setdefault("dtype", args.dtype)
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        changes["model_init_kwargs"] = kwargs
    elif args.dtype != "float32":
        warnings.warn(
            f"AsyncGRPOConfig.dtype={args.dtype!r} applies to a model loaded by name; the model given is already "
            "instantiated and keeps its dtype.",
            stacklevel=3,
        )
    with warnings.catch_warnings():  # the config was checked (and warned about) when the user built it
        warnings.simplefilter("ignore")
        return dataclasses.replace(args, **changes)
