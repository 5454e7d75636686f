"""Multi-turn environments and tool use (seed 003 §4.1, §11).

```python
from grpo_async import GRPOTrainer
from grpo_async.envs import ToolEnv, calculator

trainer = GRPOTrainer(model, reward_funcs=math_reward, args=args, train_dataset=ds, environment=ToolEnv([calculator]))
# or, TRL style: GRPOTrainer(..., tools=[calculator]), or GRPOTrainer(..., environment_factory=MyEnv) (factory.py)
```

Environment tokens are part of each completion (the model attends to them) but carry loss mask 0 when
`GRPOConfig.mask_env_responses` (the default); see `rollout.py` for how a conversation becomes one token sequence.
"""

from .base import Environment, EnvironmentProtocol, check_environment
from .factory import FactoryEnvironment, TRLToolEnv
from .rollout import ChatTemplatePrefixError, RolloutResult, env_turn_ids, run_rollouts, template_ids
from .tools import (
    ToolCallError,
    ToolEnv,
    calculator,
    parse_tool_call,
    parse_tool_calls,
    tool_metrics,
    tools_system_prompt,
)

__all__ = [
    "ChatTemplatePrefixError",
    "Environment",
    "EnvironmentProtocol",
    "FactoryEnvironment",
    "RolloutResult",
    "ToolCallError",
    "ToolEnv",
    "TRLToolEnv",
    "calculator",
    "check_environment",
    "env_turn_ids",
    "parse_tool_call",
    "parse_tool_calls",
    "run_rollouts",
    "template_ids",
    "tool_metrics",
    "tools_system_prompt",
]
