"""Command-line training scripts run by the `grpo-async` console script (`grpo-async grpo`), as TRL's `trl/scripts`."""
