"""grpo_async: an async GRPO trainer that is a real `transformers.Trainer`."""

__version__ = "0.1.0"

from .algo.advantages import compute_advantages
from .config import GRPOConfig
from .data.async_loader import AsyncDataLoaderWrapper
from .data.sampler import RepeatSampler
from .pipeline.job_queue import RoundQueue
from .pipeline.types import Round, RoundRequest
from .trainer import GRPOTrainer

__all__ = [
    "AsyncDataLoaderWrapper",
    "GRPOConfig",
    "GRPOTrainer",
    "RepeatSampler",
    "Round",
    "RoundQueue",
    "RoundRequest",
    "compute_advantages",
]
