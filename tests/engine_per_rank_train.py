"""Launched by tests/test_engine_per_rank.py on 2 processes (gloo on CPU): trains with an engine on every rank and
writes, per rank, what it trained on, what its own engine counted, and its engine's logprobs against its model's.

argv: MODEL OUT_DIR BACKEND ("hf" | "vllm" | "hf_env": hf with a multi-turn environment on every rank | "vllm_main":
in-process vLLM with groups of 16, which one rank's 8 rows of a round would split: the main process generates alone |
"vllm_eval": in-process vLLM without weight sync, `evaluate()` before `train()`)
"""

import json
import os
import sys

import torch
from support.rank_result import exit_cleanly
from support.recorders import recorded

from grpo_async import GRPOConfig
from grpo_async.algo.logprobs import selective_log_softmax
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.envs import Environment
from grpo_async.generation.base import SamplingConfig


class Echo(Environment):
    """Answers every assistant turn with `ok <n>` (turns cut at 3 tokens: the random model's rollouts are multi-turn);
    its state counts the replies, checked against the conversation by `replies_match`."""

    max_turns = 2
    max_tokens_per_turn = 3

    def initial_state(self, row):
        return {"replies": 0}

    def env_response(self, messages, state):
        n = state["replies"] + 1
        return [{"role": "user", "content": f"ok {n}"}], {"replies": n}


def replies_match(prompts, completions, env_state, **kwargs):
    """0: each rollout's final state is its own (replies = the environment's turns in its conversation)."""
    for state, conversation in zip(env_state, completions, strict=True):
        assert state["replies"] == sum(m["role"] == "user" for m in conversation), (state, conversation)
    return [0.0] * len(completions)


def _rows(micro_batch, state, processing_class):
    """Which rows a micro-batch trained (round, row index), their prompts, completions and advantages."""
    ids, mask = micro_batch.completion_ids, micro_batch.completion_mask
    completions = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    return {
        "round": micro_batch.round_id.tolist(),
        "row": micro_batch.row_index.tolist(),
        "prompt": processing_class.batch_decode(micro_batch.prompt_ids, skip_special_tokens=True),
        "completion": processing_class.batch_decode(completions, skip_special_tokens=True),
        "advantage": micro_batch.advantages.tolist(),
    }


def engine_counter(backend) -> int:
    """What the engine itself counted: HF's completions generated, vLLM's requests (`LLM.request_counter`)."""
    if hasattr(backend, "llm"):
        return backend.llm.request_counter.counter
    return backend.completions_generated


def engine_processes() -> list[str]:
    """The command lines of this process's descendants that run vLLM (an engine core, its worker)."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "VLLM" in cmd or "spawn_main" in cmd:
            found.append(cmd)
    return found


@torch.no_grad()
def engine_vs_model(trainer) -> float | None:
    """Largest |engine logprob − model logprob| of one sampled completion, after publishing the model's weights (None
    on a rank without an engine)."""
    trainer.sync_weights()  # every rank: its model into its own engine
    backend = trainer.backend
    if backend is None:
        return None
    prompt = trainer.processing_class("Say b")["input_ids"]
    (c,) = backend.generate([prompt], SamplingConfig(n=1, temperature=1.0, max_tokens=6, seed=123))
    model = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.tensor([prompt + c.completion_ids])
    logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1].float()
    model_logps = selective_log_softmax(logits, ids[:, len(prompt) :])[0]
    return float((model_logps - torch.tensor(c.logprobs)).abs().max())


def main():
    model_path, out_dir, backend = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = int(os.environ["LOCAL_RANK"])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(rank % os.cpu_count()))  # each engine its own core
    extra = {"generation_backend": "vllm", "vllm_max_model_length": 64} if backend.startswith("vllm") else {}
    if backend == "vllm_main":
        extra["num_generations"] = 16
    if backend == "vllm_eval":  # evaluate() before train(), nothing published: no weight sync to build the engines
        extra["weight_sync_transport"] = "none"
    env = {"environment": Echo()} if backend == "hf_env" else {}
    calls = []  # this rank's reward calls: one per round it scored

    def scored_letter_reward(*args, **kwargs):
        calls.append(1)
        return letter_reward(*args, **kwargs)

    scored_letter_reward.__name__ = "letter_reward"
    rewards = [scored_letter_reward, replies_match] if env else scored_letter_reward
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        save_metrics_plot=False,  # the end-of-training plot is not this run's subject (~1.3 CPU-s)
        per_device_train_batch_size=4,
        num_generations=extra.pop("num_generations", 4),
        gradient_accumulation_steps=2,
        max_completion_length=16 if env else 6,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        num_batches_ahead=1,
        scale_rewards="batch",  # std over the whole round: one rank's rows alone would give other advantages
        beta=0.0,
        seed=0,
        **extra,
    )
    evals = {"eval_dataset": make_dataset(8, seed=5)} if backend == "vllm_eval" else {}
    trainer, seen = recorded(
        model=model_path, reward_funcs=rewards, args=args, train_dataset=make_dataset(64), record=_rows, **env, **evals
    )
    evaluated = sorted(trainer.evaluate()) if evals else []
    trainer.train()
    children = engine_processes()  # the engine runs inside this process unless it is the only one (vllm_main)
    counted = engine_counter(trainer.backend) if trainer.backend is not None else None
    logp_gap = engine_vs_model(trainer)
    version = trainer.backend.version if trainer.backend is not None else None
    trainer.close()
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    with open(os.path.join(out_dir, f"rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(
            {
                "rank": trainer.accelerator.process_index,
                "world": trainer.accelerator.num_processes,
                "seen": seen.records,
                "engine_counter": counted,
                "engine_processes": children,
                "evaluated": evaluated,
                "rounds_scored": len(calls),
                "engine_version": version,
                "global_step": trainer.state.global_step,
                "logp_gap": logp_gap,
                "param_checksum": float(params.double().sum()),
                "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
                "env_turns": [h["env/turns/mean"] for h in trainer.state.log_history if "env/turns/mean" in h],
            },
            f,
        )


if __name__ == "__main__":
    main()
    exit_cleanly()  # the DDP reducer freed before the process group (tests/support/rank_result.py)
