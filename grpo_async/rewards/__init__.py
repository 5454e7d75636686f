"""Reward functions: TRL's calling convention, checked and timed.

A reward function is `f(prompts, completions, completion_ids, **columns) -> list[float | None]`, one value per
completion; dataset columns arrive as keyword lists aligned with the completions (plus `trainer_state` when called
by the trainer, as in TRL, and TRL's `log_extra(column, values)` / `log_metric(name, value)` callables, collected
per round by `RewardLogs`). `None` means "not applicable" (NaN): a completion every function returns None for is
unscorable and gets advantage 0. `async def` functions run concurrently with each other.

What TRL 1.16 leaves undefined is an error here, naming the function: raising, returning the wrong number of values,
returning a non-number, returning `inf` or a bare `NaN` (say "not applicable" with `None`), and running longer than
`GRPOConfig.reward_timeout` seconds.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import torch

from .builtin import format_reward, length_penalty, math_reward

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., list]

__all__ = [
    "RewardFunc",
    "RewardLogs",
    "RewardTimeoutError",
    "format_reward",
    "length_penalty",
    "math_reward",
    "prepare_reward_funcs",
    "check_reward_signatures",
    "reward_func_name",
    "score_completions",
    "signature_problem",
]


class RewardLogs:
    """What the reward functions of one round logged through TRL's keyword arguments: `log_extra(column, values)`
    adds a column to the completions table (one value per completion), `log_metric(name, value)` a scalar metric
    (averaged over the round's calls, then over the logging window, as TRL averages it).

    >>> logs = RewardLogs()
    >>> logs.log_metric("parse_ok", 1.0); logs.log_metric("parse_ok", 0.0); logs.log_extra("answer", ["3", "4"])
    >>> logs.metric_means(), logs.extra
    ({'parse_ok': 0.5}, {'answer': ['3', '4']})
    """

    def __init__(self):
        self.extra: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = {}

    def log_extra(self, column: str, values) -> None:
        if not isinstance(column, str):
            raise TypeError(f"log_extra(column, values): column must be a str, got {type(column).__name__}")
        self.extra.setdefault(column, []).extend(list(values))

    def log_metric(self, name: str, value) -> None:
        if not isinstance(name, str):
            raise TypeError(f"log_metric(name, value): name must be a str, got {type(name).__name__}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"log_metric({name!r}, {value}): the value must be finite")
        self.metrics.setdefault(name, []).append(value)

    def metric_means(self) -> dict[str, float]:
        return {name: sum(v) / len(v) for name, v in self.metrics.items()}

    def check_extra(self, n: int) -> None:
        """Each extra column has one value per completion of the round (`n`), or the table could not hold it."""
        for column, values in self.extra.items():
            if len(values) != n:
                raise ValueError(
                    f"log_extra({column!r}, ...) logged {len(values)} values for a round of {n} completions; log one "
                    "value per completion"
                )


class RewardTimeoutError(TimeoutError):
    """A reward function did not return within `GRPOConfig.reward_timeout` seconds."""


def reward_func_name(func: RewardFunc) -> str:
    name = getattr(func, "__name__", None)
    if name is None and hasattr(func, "func"):  # functools.partial
        name = getattr(func.func, "__name__", None)
    return name or type(func).__name__


def _is_async(func) -> bool:
    call = type(func).__call__ if not inspect.isroutine(func) else None
    return inspect.iscoroutinefunction(func) or (call is not None and inspect.iscoroutinefunction(call))


def prepare_reward_funcs(
    reward_funcs, reward_processing_classes=None, model_init_kwargs: dict | None = None, device=None
) -> tuple[list[RewardFunc], list[str]]:
    """Normalise to a list of callables and their (unique) names; raise on anything else. `None` or `[]` gives no
    functions (TRL: allowed when an environment brings the reward; the trainer checks that one does).

    As in TRL, an entry may be a reward model: a model id or path (loaded as a sequence classifier with
    `model_init_kwargs`) or a `PreTrainedModel`; `reward_processing_classes[i]` is its tokenizer (loaded from the
    model's name when `None`). Reward models are moved to `device` and scored by `RewardModel`."""
    from transformers import PreTrainedModel

    from .reward_model import RewardModel

    if reward_funcs is None:
        reward_funcs = []
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    tokenizers = reward_processing_classes
    if tokenizers is None:
        tokenizers = [None] * len(funcs)
    elif not isinstance(tokenizers, (list, tuple)):
        tokenizers = [tokenizers]
    if len(tokenizers) != len(funcs):
        raise ValueError(  # TRL's text; then ours: what to give
            f"The number of reward processing classes ({len(tokenizers)}) must match the number of reward functions "
            f"({len(funcs)}). reward_processing_classes has {len(tokenizers)} entries for {len(funcs)} reward "
            "functions; give one per reward function (None for plain functions)"
        )
    for i, (f, tok) in enumerate(zip(funcs, tokenizers, strict=True)):
        if isinstance(f, str):
            funcs[i] = RewardModel.load(f, tok, **dict(model_init_kwargs or {}))
        elif isinstance(f, PreTrainedModel):
            if tok is None:
                from ..loading import load_tokenizer

                tok = load_tokenizer(f.config._name_or_path)
            funcs[i] = RewardModel(f, tok)
        if isinstance(funcs[i], RewardModel) and device is not None:
            funcs[i].model.to(device)
    names = []
    for i, f in enumerate(funcs):
        if not callable(f):
            raise TypeError(
                f"reward_funcs[{i}] is a {type(f).__name__}, not a callable "
                "f(prompts, completions, completion_ids, **kwargs) -> list[float | None]"
            )
        name = reward_func_name(f)
        names.append(name if name not in names else f"{name}_{i}")
    return funcs, names


#: the keywords every reward call passes besides the dataset's columns (`RoundProducer.score`)
ALWAYS_PASSED = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def _signature_gaps(func, passed) -> tuple[list[str], list[str], list[str]] | None:
    """`(unexpected, missing, own)` of calling `func(**{k: ... for k in passed})`: keywords it cannot take, required
    parameters not among `passed`, and the passed ones it names; None when the signature cannot be read."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        unexpected = []
    else:
        takes = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unexpected = sorted(k for k in passed if k not in takes)
    missing = [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and (p.kind is p.POSITIONAL_ONLY or p.name not in passed)
    ]
    own = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name in passed]
    return unexpected, missing, own


def _problem_text(func, name: str, passed, unexpected: list[str], missing: list[str], own: list[str]) -> str:
    what = []
    if unexpected:
        what.append(f"it does not take {', '.join(map(repr, unexpected))}")
    if missing:
        what.append(f"it requires {', '.join(map(repr, missing))}, which no dataset column or trainer argument gives")
    example = ", ".join([*(own or ["completions"]), "**kwargs"])
    return (
        f"reward function {name!r} cannot be called the way the trainer calls it: {'; '.join(what)}. Reward "
        f"functions are called with keywords only, as in TRL: {', '.join(sorted(passed))}. Name the ones you use "
        f"and take the rest with **kwargs, e.g. `def {getattr(func, '__name__', name)}({example}): ...`"
    )


def signature_problem(func, name: str, passed) -> str | None:
    """Why `func(**{k: ... for k in passed})` fails on its signature alone (an unexpected keyword, a required
    parameter not among `passed`), as one message naming the function and the fix; None when it fits or when the
    signature cannot be read. The trainer checks it at construction with the keywords it knows then (and the same
    message explains a round's `TypeError`)."""
    gaps = _signature_gaps(func, passed)
    if gaps is None or not (gaps[0] or gaps[1]):
        return None
    return _problem_text(func, name, passed, *gaps)


def check_reward_signatures(funcs: Sequence[RewardFunc], names: Sequence[str], columns, open_ended: bool) -> None:
    """At construction: every reward function can take the keywords a round passes (`ALWAYS_PASSED` and the train
    set's `columns`). A keyword it cannot take fails every call: `TypeError` with `signature_problem`'s message
    (not checked when `open_ended`: an environment or rollout function adds fields known only at run time). A
    required parameter no column gives fails every training round but may come from an evaluation set's column: a
    warning with the same message."""
    from .reward_model import RewardModel

    passed = set(ALWAYS_PASSED) | {c for c in columns if c not in ("prompt", "completion", "completion_ids")}
    for func, name in zip(funcs, names, strict=True):
        if isinstance(func, RewardModel) or not callable(func):  # a model scores texts: its own call, checked there
            continue
        target = func if inspect.isfunction(func) or inspect.ismethod(func) else func.__call__
        gaps = _signature_gaps(target, passed)
        if gaps is None:
            continue
        unexpected, missing, _ = gaps
        if unexpected and not open_ended:
            raise TypeError(_problem_text(target, name, passed, *gaps))
        if missing:
            problem = _problem_text(target, name, passed, *gaps)
            logger.warning("%s (an evaluation set with that column is fine; training rounds will fail)", problem)


def _timeout_error(names: list[str], timeout: float) -> RewardTimeoutError:
    which = ", ".join(repr(n) for n in names)
    return RewardTimeoutError(
        f"reward function {which} did not return within GRPOConfig.reward_timeout={timeout:g} s; "
        "a hung synchronous function cannot be stopped, so its worker thread is abandoned. Make it faster, "
        "give it its own timeout, or raise reward_timeout (None disables the limit)."
    )


#: seconds the interpreter waits at exit for a call abandoned by a shutdown when the call had no `timeout`
ABANDONED_JOIN_S = 60.0
#: reward threads abandoned by a shutdown (`abort`), with the monotonic deadline of their call
_ABANDONED: list[tuple[threading.Thread, float]] = []


def _join_abandoned_at_exit() -> None:
    """Wait (until each call's own deadline) for reward threads a shutdown abandoned: the interpreter must not finalize
    under a thread running torch code (`terminate called without an active exception`, exit 134)."""
    for thread, deadline in _ABANDONED:
        left = deadline - time.monotonic()
        if thread.is_alive() and left > 0:
            logger.warning("waiting up to %.0fs at exit for %s, abandoned by a shutdown", left, thread.name)
            thread.join(left)


atexit.register(_join_abandoned_at_exit)


def _in_worker(
    fn: Callable[[], object], timeout: float | None, thread_name: str, abort: threading.Event | None = None
):
    """Run `fn()` in a daemon thread and wait at most `timeout` seconds, or until `abort` is set (checked every 0.05 s:
    the generator's shutdown must not wait out a hung function). Returns `(finished, result, exception)`; raises
    `GenerationAborted` when `abort` ended the wait; the abandoned thread is then joined at interpreter exit until
    the call's deadline (`_join_abandoned_at_exit`)."""
    box: dict = {}
    done = threading.Event()

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # handed to the caller
            box["err"] = e
        finally:
            done.set()

    thread = threading.Thread(target=run, name=thread_name, daemon=True)
    thread.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    finished = False
    while not finished:
        if abort is not None and abort.is_set():
            from ..generation.base import GenerationAborted

            _ABANDONED[:] = [(t, d) for t, d in _ABANDONED if t.is_alive()]
            _ABANDONED.append((thread, deadline if deadline is not None else time.monotonic() + ABANDONED_JOIN_S))
            raise GenerationAborted(f"{thread_name}: the reward call was abandoned (the generator is shutting down)")
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        finished = done.wait(0.05 if left is None else min(left, 0.05))
    return finished, box.get("out"), box.get("err")


def _call_sync(func, name: str, kwargs: dict, timeout: float | None, abort: threading.Event | None = None):
    if timeout is None and abort is None:
        try:
            return func(**kwargs)
        except TypeError as e:
            raise RuntimeError(
                signature_problem(func, name, kwargs) or f"reward function {name!r} raised TypeError: {e}"
            ) from e
        except Exception as e:
            raise RuntimeError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
    finished, out, err = _in_worker(lambda: func(**kwargs), timeout, f"reward-{name}", abort)
    if not finished:
        raise _timeout_error([name], timeout)
    if isinstance(err, TypeError) and signature_problem(func, name, kwargs):
        raise RuntimeError(signature_problem(func, name, kwargs)) from err
    if err is not None:
        raise RuntimeError(f"reward function {name!r} raised {type(err).__name__}: {err}") from err
    return out


def _call_async(
    funcs: dict[int, RewardFunc],
    names: Sequence[str],
    kwargs: dict,
    timeout: float | None,
    abort: threading.Event | None = None,
) -> dict:
    """Await every async function concurrently on a private event loop in a worker thread (so a caller that already
    runs a loop works too). Each gets `timeout` seconds; one that blocks the loop is caught by the outer deadline."""
    finished: set[int] = set()

    async def one(i, f):
        coro = f(**kwargs)
        try:
            out = await (asyncio.wait_for(coro, timeout) if timeout is not None else coro)
        except asyncio.TimeoutError:
            raise _timeout_error([names[i]], timeout) from None
        finished.add(i)
        return out

    async def everything():
        return await asyncio.gather(*(one(i, f) for i, f in funcs.items()), return_exceptions=True)

    outer = None if timeout is None else timeout + 1.0
    done, outs, err = _in_worker(lambda: asyncio.run(everything()), outer, "reward-async", abort)
    if not done:
        raise _timeout_error([names[i] for i in funcs if i not in finished], timeout)
    if err is not None:
        raise err
    results = {}
    for i, out in zip(funcs, outs, strict=True):
        if isinstance(out, RewardTimeoutError):
            raise out
        if isinstance(out, BaseException):
            raise RuntimeError(f"reward function {names[i]!r} raised {type(out).__name__}: {out}") from out
        results[i] = out
    return results


def _as_list(out):
    """A 1-D numpy array or torch tensor as a list (TRL accepts them); anything else unchanged."""
    if isinstance(out, torch.Tensor) and out.dim() == 1:
        return out.detach().cpu().tolist()
    if type(out).__module__ == "numpy" and getattr(out, "ndim", None) == 1:
        return out.tolist()
    return out


def _as_reward(v, name: str, j: int) -> float | None:
    """One reward value as a finite float, or None ("not applicable"). Numbers only: a Python/numpy number or a
    0-d tensor; a string such as `"1.0"` is an error (it is a bug in the function, not a reward)."""
    if v is None:
        return None
    is_number = isinstance(v, (int, float))  # bool included, as TRL
    is_number |= type(v).__module__ == "numpy" and getattr(v, "ndim", None) == 0 and hasattr(v, "dtype")
    is_number |= isinstance(v, torch.Tensor) and v.dim() == 0
    if not is_number or isinstance(v, (str, bytes)):
        raise ValueError(
            f"reward function {name!r} returned {v!r} at index {j} (a {type(v).__name__}); expected a number "
            "(int, float, numpy or 0-d torch number) or None"
        )
    x = float(v)
    if not math.isfinite(x):
        raise ValueError(
            f"reward function {name!r} returned {x} at index {j}; rewards must be finite "
            "(return None for a completion the function does not apply to)"
        )
    return x


def score_completions(
    funcs: Sequence[RewardFunc],
    names: Sequence[str],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    timeout: float | None = None,
    abort: threading.Event | None = None,
) -> torch.Tensor:
    """Call every reward function once on the whole round. Returns `[B, F]` float32 with NaN for `None`.

    Synchronous functions run one after the other (each in a worker thread when `timeout` or `abort` is set), then
    the `async def` ones all at once. `timeout` (seconds, per function call) raises `RewardTimeoutError` naming it.
    `abort` (set by another thread, e.g. the generator's shutdown) ends the wait for a function within 0.05 s with
    `GenerationAborted`; the function's thread is abandoned, as on a timeout.
    """
    n = len(completions)
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    results: list = [None] * len(funcs)
    async_funcs = {}
    for i, (f, name) in enumerate(zip(funcs, names, strict=True)):
        if _is_async(f):
            async_funcs[i] = f
        else:
            results[i] = _call_sync(f, name, kwargs, timeout, abort)
    if async_funcs:
        for i, out in _call_async(async_funcs, names, kwargs, timeout, abort).items():
            results[i] = out
    table = torch.empty(n, len(funcs), dtype=torch.float32)  # [B, F]
    for i, (out, name) in enumerate(zip(results, names, strict=True)):
        out = _as_list(out)
        if not isinstance(out, (list, tuple)) or len(out) != n:
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
            raise ValueError(f"reward function {name!r} returned {got} for {n} completions; return one per completion")
        for j, v in enumerate(out):
            x = _as_reward(v, name, j)
            table[j, i] = math.nan if x is None else x
    unscorable = torch.isnan(table).all(dim=1)  # [B]
    if unscorable.any():
        j = int(unscorable.nonzero()[0, 0])
        row = {k: v[j] for k, v in kwargs.items() if isinstance(v, list) and len(v) == n and k != "completion_ids"}
        row = {"prompt": row.pop("prompts", None), "completion": row.pop("completions", None), **row}
        logger.warning(  # TRL's words, then how many and what happens to them here
            "All reward functions returned None for the following kwargs:\n%s\nPlease ensure that at least one reward "
            "function returns a valid reward. (%d completion(s) of this round, first at index %d; they get advantage "
            "0.)",
            row,
            int(unscorable.sum()),
            j,
        )
    return table
