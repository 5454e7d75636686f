"""`grpo_async/pipeline/build.py`: one function builds the pipeline's components from the config and joins them."""

import re

import torch

from grpo_async import GRPOTrainer
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.pipeline import build
from grpo_async.testing import tiny_config


def test_the_docstring_table_names_every_component_and_its_file():
    table = build.__doc__.split("```txt")[1].split("```")[0]
    rows = [line for line in table.splitlines()[3:] if line and not line.startswith(" ") and not line.startswith("(")]
    assert [row.split()[0] for row in rows] == [
        "engine",
        "PolicyPublisher",
        "RoundProducer",
        "RoundConsumer",
        "RoundScheduler",
        "RoundJoiner",
        "LogpsScorer",
        "Evaluator",
    ]
    modules = ("publisher.py", "producer.py", "consumer.py", "scheduler.py", "shared.py", "join.py", "reference.py")
    for module in (*modules, "evaluation.py"):
        assert module in table, module
    assert set(build.Pipeline.__dataclass_fields__) == {
        "engine",
        "publisher",
        "producer",
        "consumer",
        "scheduler",
        "evaluator",
        "collectives",
        "ref_client",
        "per_rank",
        "importance_sampling",
    }


def test_trainer_components_are_the_ones_build_joined(tiny_model_path, tmp_path):
    t = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=tiny_config(tmp_path / "out", max_steps=2),
        train_dataset=make_dataset(16),
    )
    # one engine, shared by whoever generates or loads weights; the scheduler drives the others
    assert t.publisher.backend is t.engine and t.producer.backend is t.engine
    assert t.rounds.producer is t.producer and t.rounds.consumer is t.consumer and t.rounds.publisher is t.publisher
    assert t.rounds.dist.is_main and t.rounds.dist.num_processes == 1
    assert t.publisher.published is None
    t.train()
    # the scheduler published the policy itself at each round boundary (no callback into the trainer): the
    # engine's weights are the trainer's after the last publish, and the sync was timed
    assert t.publisher.published == t.state.global_step - 1 or t.publisher.published == t.state.global_step
    logs = [h for h in t.state.log_history if "timing/weight_sync" in h]
    assert logs and all(h["timing/weight_sync"] >= 0 for h in logs)
    engine_model = t.backend.model
    t.sync_weights()  # publishes the trainer's current weights now
    live = t.accelerator.unwrap_model(t.model).state_dict()
    pushed = engine_model.state_dict()
    assert all(torch.equal(live[k].cpu(), pushed[k].cpu()) for k in live), "the engine holds the trainer's weights"
    t.close()


def test_trainer_init_builds_the_pipeline_without_closures():
    import inspect

    source = inspect.getsource(GRPOTrainer.__init__)
    assert "build_pipeline(" in source
    assert not re.search(r"\blambda\b", source)
