"""grpo_async."""
