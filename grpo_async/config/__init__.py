"""`GRPOConfig` and its parts: one module per concern.

```txt
grpo_config.py   GRPOConfig: the field groups joined onto TrainingArguments, __post_init__, derived properties
model.py generation.py weight_sync.py pipeline.py loss.py reference.py completions.py trl_fields.py
                 the fields, one dataclass per concern, each with its help and per-field constraint
checks.py        per-field constraints (Number, OneOf, InstanceOf, Literal types) and check_fields
rules.py         RULES: the table of cross-field rules, and check_rules
derived.py       markers of values derived from other fields (is_derived)
trl_compat.py    TRL 1.16 tables (aliases, deprecated, default differences, unsupported fields), keyword translation
```

The generation backends a config may name are registered in `grpo_async.generation` (`register_backend`).
"""

from .derived import is_derived
from .grpo_config import FIELD_GROUPS, SECRET_FIELDS, GRPOConfig
from .rules import RULES, Rule
from .trl_compat import (
    DEFAULT_DIFFERENCES,
    TRL_ALIASES,
    TRL_DEPRECATED,
    TRL_LOSS_TYPES,
    UNSUPPORTED_TRL_FIELDS,
    UNSUPPORTED_TRL_INSTEAD,
)

__all__ = [
    "DEFAULT_DIFFERENCES",
    "FIELD_GROUPS",
    "GRPOConfig",
    "RULES",
    "Rule",
    "SECRET_FIELDS",
    "TRL_ALIASES",
    "TRL_DEPRECATED",
    "TRL_LOSS_TYPES",
    "UNSUPPORTED_TRL_FIELDS",
    "UNSUPPORTED_TRL_INSTEAD",
    "is_derived",
]
