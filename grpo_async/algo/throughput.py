"""Throughput of training: trained tokens per second, training FLOPs per second and, on a GPU whose peak is known,
model FLOPs utilisation. FLOPs per token and the peak table are TRL's (`trl.trainer.utils.compute_flops_per_token`,
`get_peak_flops`, `compute_mfu`), imported, never copied; without them (or for a config they cannot read) only the
token rate is reported.

```txt
compute_loss (each micro-batch) ─▶ meter.add(real tokens, rows)
end of the optimizer step       ─▶ meter.step(seconds of training compute) ─▶ perf/train_tokens_per_second
                                                                              perf/flops_per_second, perf/mfu
```
Tokens are the rows' real tokens (prompt + completion), per device: a shared-prompt forward
(`algo.prefix_sharing`) computes fewer, so it shows as more tokens (and "FLOPs") per second, the work it saved.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def generated_tokens_per_second(completion_tokens: float, generation_seconds: float) -> float | None:
    """Completion tokens of a round over the seconds its generation took; `None` when no time was measured."""
    return completion_tokens / generation_seconds if generation_seconds > 0 else None


class ThroughputMeter:
    """Counts one optimizer step's trained tokens and turns them into per-second metrics.

    Args:
        model_config: the policy's transformers config (its text config is read).
        device (`torch.device`): the training device (a CUDA device's name looks up its peak FLOPs).
        dtype (`str`): the matmul precision, `"bfloat16"`, `"float16"` or `"float32"` (TRL's peak table keys).

    Example:
        >>> meter = ThroughputMeter(None, device=torch.device("cpu"), dtype="float32")  # no config: tokens only
        >>> meter.add(tokens=300, rows=2); meter.add(tokens=100, rows=2)
        >>> meter.step(seconds=2.0)
        {'perf/train_tokens_per_second': 200.0}
    """

    def __init__(self, model_config, *, device: torch.device, dtype: str):
        self.config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.tokens, self.rows = 0, 0
        self._flops_per_token = self._mfu = None
        self.peak_flops = None
        try:
            from trl.trainer.utils import compute_flops_per_token, compute_mfu, get_peak_flops
        except ImportError:  # pragma: no cover (TRL is a dependency)
            return
        if self.config is not None:
            self._flops_per_token, self._mfu = compute_flops_per_token, compute_mfu
        if device.type == "cuda":
            self.peak_flops = get_peak_flops(torch.cuda.get_device_name(device), dtype)

    def add(self, tokens: int, rows: int) -> None:
        """One micro-batch: its real tokens and rows."""
        self.tokens += int(tokens)
        self.rows += int(rows)

    def step(self, seconds: float) -> dict[str, float]:
        """The metrics of the step just ended (`seconds` of training compute), then start counting the next."""
        tokens, rows = self.tokens, self.rows
        self.tokens, self.rows = 0, 0
        if seconds <= 0 or not tokens:
            return {}
        rate = tokens / seconds
        out = {"perf/train_tokens_per_second": rate}
        if self._flops_per_token is None:
            return out
        try:
            per_token = self._flops_per_token(self.config, max(1, round(tokens / rows)))  # mean sequence length
        except (AttributeError, TypeError) as e:  # a config TRL's formula cannot read (no num_key_value_heads, ...)
            logger.info("perf/flops_per_second is off: %s", e)
            self._flops_per_token = None
            return out
        out["perf/flops_per_second"] = per_token * rate
        if self.peak_flops:
            out["perf/mfu"] = self._mfu(per_token, rate, 1, self.peak_flops)  # this device's share
        return out


def throughput_meter(model_config, accelerator, model) -> ThroughputMeter:
    """The meter for a trainer's device and precision (accelerate's mixed precision, else the weights' dtype)."""
    precision = accelerator.mixed_precision
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(precision) or str(next(model.parameters()).dtype)
    return ThroughputMeter(model_config, device=accelerator.device, dtype=dtype.removeprefix("torch."))
