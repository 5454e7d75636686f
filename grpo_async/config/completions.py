"""Logging fields of `GRPOConfig` besides `report_to`: the completions table and the end-of-training plot."""

from dataclasses import dataclass, field

from .checks import Number, checked_field


@dataclass
class CompletionLogFields:
    """Which completions are printed when logging; whether the run's metrics are plotted at its end."""

    log_completions: bool = field(default=False, metadata={"help": "Print a sample of completions when logging."})
    num_completions_to_print: int | None = checked_field(
        Number(ge=0, integer=True, optional=True, what="an int >= 0 or None (all)"),
        default=4,
        metadata={"help": "Completions printed per log; None prints all of them."},
    )
    log_multimodal: bool = field(
        default=True,
        metadata={
            "help": "Vision-language models, with log_completions: the completions table "
            "(output_dir/completions/step_*.parquet) holds each row's images as PNG bytes (column `images`); TRL "
            "logs them to its trackers. Text models: no effect."
        },
    )
    save_metrics_plot: bool = field(
        default=True,
        metadata={
            "help": "At the end of training the main process draws output_dir/metrics.png from "
            "output_dir/metrics.jsonl (matplotlib: about a CPU-second). False: no plot; `grpo-async plot OUTPUT_DIR` "
            "draws it at any time."
        },
    )
