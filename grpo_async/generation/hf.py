"""`HFBackend`: generation with `transformers.generate` on a private copy of the policy.

The copy is what makes background generation safe: the generator thread reads only the copy, the optimizer writes
only the trainer's model, and `update_weights` (called between rounds) copies the new weights over.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Mapping

import torch

from ..weight_sync.buckets import group_by_module
from .base import Completion, SamplingConfig, check_completions

logger = logging.getLogger(__name__)


class HFBackend:
    """Generate with `model.generate` on a frozen copy of `model`.

    Args:
        model (`PreTrainedModel`): the base architecture (no PEFT wrapper); it is deep-copied, never used directly.
        tokenizer: pad/eos ids and stop strings come from it.
        batch_size (`int`, *optional*): prompts per `generate` call (all at once when `None`).
    """

    def __init__(self, model, tokenizer, batch_size: int | None = None):
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.version = 0
        self._lock = threading.Lock()
        eos = self.model.generation_config.eos_token_id
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])

    @torch.no_grad()
    def load_weights(self, groups, version: int) -> None:
        """Copy `(module, [(hf_name, tensor), ...])` groups into the generation copy, one group at a time."""
        with self._lock:
            params = dict(self.model.named_parameters())
            for _, tensors in groups:
                unknown = [k for k, _ in tensors if k not in params]
                if unknown:
                    raise KeyError(f"HFBackend.load_weights: unknown parameter names {unknown[:5]}")
                for name, tensor in tensors:
                    params[name].copy_(tensor.to(params[name].device, params[name].dtype))
            self.version = version

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.load_weights(group_by_module(state_dict), version)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        with self._lock:
            out: list[Completion] = []
            step = self.batch_size or len(prompt_ids)
            for start in range(0, len(prompt_ids), step):
                out.extend(self._generate_chunk(prompt_ids[start : start + step], sampling))
            return check_completions(out, len(prompt_ids), sampling.n, "HFBackend")

    def _generate_chunk(self, prompt_ids: list[list[int]], s: SamplingConfig) -> list[Completion]:
        pad = self.tokenizer.pad_token_id
        device = next(self.model.parameters()).device
        P = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), P), pad, dtype=torch.long)  # [b, P] left-padded
        attention_mask = torch.zeros((len(prompt_ids), P), dtype=torch.long)  # [b, P]
        for i, p in enumerate(prompt_ids):
            input_ids[i, P - len(p) :] = torch.tensor(p)
            attention_mask[i, P - len(p) :] = 1
        kwargs = dict(
            do_sample=True,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else None,
            min_p=s.min_p if s.min_p > 0 else None,
            max_new_tokens=s.max_tokens,
            num_return_sequences=s.n,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
            eos_token_id=sorted(self.eos_ids),
            synced_gpus=False,  # one process generates on its private copy (the default syncs ranks under ZeRO-3)
        )
        if s.stop:
            kwargs.update(stop_strings=s.stop, tokenizer=self.tokenizer)
        if s.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = s.repetition_penalty
        kwargs.update(s.extra or {})  # generation_kwargs: GenerationConfig fields
        gen = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs)
        seqs = gen.sequences[:, P:].cpu()  # [b*n, T]
        # scores: processed (temperature / top-k / top-p) logits of each step, [b*n, V] per step
        logps = torch.stack([torch.log_softmax(sc.float(), dim=-1) for sc in gen.scores], dim=1).cpu()  # [b*n,T,V]
        token_logps = logps.gather(-1, seqs.unsqueeze(-1)).squeeze(-1)  # [b*n, T]
        completions = []
        for row, lp in zip(seqs.tolist(), token_logps.tolist(), strict=True):
            end = next((j + 1 for j, t in enumerate(row) if t in self.eos_ids), None)
            reason = "stop" if end is not None else "length"
            if end is None:
                end = len(row)
                # stop strings end generation without EOS: trim trailing padding
                while end > 0 and row[end - 1] == pad and pad not in self.eos_ids:
                    end -= 1
                if end < s.max_tokens:
                    reason = "stop"
            completions.append(Completion(completion_ids=row[:end], logprobs=lp[:end], finish_reason=reason))
        return completions

    def close(self) -> None:
        self.model = None
