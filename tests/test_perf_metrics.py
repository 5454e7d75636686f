"""Throughput metrics (`grpo_async.algo.throughput`, issue 25): trained and generated tokens per second, training
FLOPs per second from TRL's FLOPs-per-token formula, MFU from TRL's peak table on a GPU it knows; a real run logs them
and `grpo-async plot` draws them."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig
from trl.trainer.utils import compute_flops_per_token

from grpo_async.algo.throughput import ThroughputMeter, generated_tokens_per_second
from grpo_async.plotting import METRICS_FILE, PLOT_FILE, metric_panels, plot_metrics, read_metrics


def test_meter_tokens_flops_and_mfu(tiny_model_path):
    config = AutoConfig.from_pretrained(tiny_model_path)
    meter = ThroughputMeter(config, device=torch.device("cpu"), dtype="float32")
    assert meter.peak_flops is None  # a CPU: no peak, no MFU
    meter.add(tokens=300, rows=10)  # mean row length 30
    meter.add(tokens=100, rows=10)  # mean over the step: 400 / 20 = 20
    out = meter.step(seconds=4.0)
    per_token = compute_flops_per_token(config, 20)  # TRL's formula (forward + backward), imported not copied
    assert out == {"perf/train_tokens_per_second": 100.0, "perf/flops_per_second": per_token * 100.0}
    assert meter.step(seconds=1.0) == {}  # counting restarted: nothing trained since
    meter.peak_flops = 1e12  # as TRL's table gives for a known GPU
    meter.add(tokens=500, rows=25)
    out = meter.step(seconds=1.0)
    assert out["perf/mfu"] == pytest.approx(100 * compute_flops_per_token(config, 20) * 500 / 1e12)


def test_generated_tokens_per_second():
    assert generated_tokens_per_second(600.0, 2.0) == 300.0
    assert generated_tokens_per_second(600.0, 0.0) is None  # no time measured (e.g. a round restored from disk)


@pytest.mark.gpu
def test_mfu_on_a_known_gpu(tiny_model_path):
    from trl.trainer.utils import get_peak_flops

    device = torch.device("cuda")
    if get_peak_flops(torch.cuda.get_device_name(device), "bfloat16") is None:
        pytest.skip(f"TRL's peak table does not know {torch.cuda.get_device_name(device)}")
    meter = ThroughputMeter(AutoConfig.from_pretrained(tiny_model_path), device=device, dtype="bfloat16")
    meter.add(tokens=1000, rows=10)
    assert 0 < meter.step(seconds=1.0)["perf/mfu"] < 100


def test_a_run_logs_and_plots_the_throughput(tiny_model_path, tmp_path):
    from grpo_async import GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset
    from grpo_async.testing import tiny_config

    out = tmp_path / "run"
    args = tiny_config(out, max_steps=2, shuffle_dataset=False)
    trainer = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(32))
    try:
        trainer.train()
    finally:
        trainer.close()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    for h in logged:
        assert h["perf/train_tokens_per_second"] > 0 and h["perf/flops_per_second"] > 0
        assert h["perf/generated_tokens_per_second"] > 0
        assert "perf/mfu" not in h  # a CPU has no known peak
        # FLOPs per second = TRL's per-token FLOPs (at some mean row length) × tokens per second
        per_token = h["perf/flops_per_second"] / h["perf/train_tokens_per_second"]
        assert (
            compute_flops_per_token(trainer.model.config, 1)
            < per_token
            < compute_flops_per_token(trainer.model.config, 64)
        )
    rows = [r for r in read_metrics(os.path.join(out, METRICS_FILE)) if "train_runtime" not in r]
    panels = {title: [k for k, _ in series] for title, _, series in metric_panels(rows)}
    assert panels["throughput"] == ["perf/train_tokens_per_second", "perf/generated_tokens_per_second"]
    assert panels["training FLOPs per second"] == ["perf/flops_per_second"]
    assert "model FLOPs utilisation" not in panels
    # `tiny_config` turns the end-of-training plot off (`save_metrics_plot=False`; test_logging's run draws it):
    # metrics.jsonl is there, metrics.png is not, and `grpo-async plot`'s function still draws it from the file
    assert not os.path.exists(out / PLOT_FILE)
    png = plot_metrics(os.path.join(out, METRICS_FILE), str(tmp_path / PLOT_FILE))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
