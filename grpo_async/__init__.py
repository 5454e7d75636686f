"""grpo_async: an async GRPO trainer that is a real `transformers.Trainer`.

The public names below are imported on first use (PEP 562), so `grpo-async --help`, `grpo-async plot` and vLLM's
plugin hook (`grpo_async.weight_sync.vllm_engine`, loaded in every vLLM process) do not pay for importing torch,
transformers and peft through the trainer; that first use imports them with the garbage collector paused
(`gc_tuning`: ~25% less CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .gc_tuning import import_module

__version__ = "0.1.0"

#: public name -> module that defines it
_EXPORTS = {
    "AsyncBatchGenerator": ".pipeline.batch_generator",
    "AsyncDataLoaderWrapper": ".data.async_loader",
    "AsyncGRPOConfig": ".trl_async",
    "AsyncGRPOTrainer": ".trl_async",
    "BatchRequest": ".pipeline.batch_generator",
    "BatchResult": ".pipeline.batch_generator",
    "GRPOCallback": ".callbacks",
    "GRPOConfig": ".config",
    "GRPOTrainer": ".trainer",
    "RepeatSampler": ".data.sampler",
    "Round": ".pipeline.types",
    "RoundRequest": ".pipeline.types",
    "TrainingInterrupted": ".interrupt",
    "compute_advantages": ".algo.advantages",
}

__all__ = [
    "AsyncBatchGenerator",
    "AsyncDataLoaderWrapper",
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "BatchRequest",
    "BatchResult",
    "GRPOCallback",
    "GRPOConfig",
    "GRPOTrainer",
    "RepeatSampler",
    "Round",
    "RoundRequest",
    "TrainingInterrupted",
    "compute_advantages",
]
assert sorted(_EXPORTS) == __all__

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .algo.advantages import compute_advantages
    from .callbacks import GRPOCallback
    from .config import GRPOConfig
    from .data.async_loader import AsyncDataLoaderWrapper
    from .data.sampler import RepeatSampler
    from .interrupt import TrainingInterrupted
    from .pipeline.batch_generator import AsyncBatchGenerator, BatchRequest, BatchResult
    from .pipeline.types import Round, RoundRequest
    from .trainer import GRPOTrainer
    from .trl_async import AsyncGRPOConfig, AsyncGRPOTrainer


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'grpo_async' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
