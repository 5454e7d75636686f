"""Reference logprobs from a frozen `grpo-async serve` server (seed 004's logprob workers), so the trainer holds no
reference copy of the model (`GRPOConfig.ref_server_url`, used when `beta > 0`).

The server is started on the reference weights and never receives a weight update (the trainer only ever pushes
to its generation backend). It answers `POST /ws/logprobs` with `log_softmax(logits / temperature)` of the given
completion tokens (see `grpo_async.generation.serve`).

Shapes: `B` rows, `P` prompt columns (left-padded), `T` completion columns (right-padded).
"""

from __future__ import annotations

import torch

from grpo_async.net import ServerClient


class RefLogpsClient:
    """Asks a reference server for the per-token logps of completions.

    Args:
        url (`str`): base URL of the frozen `grpo-async serve` server.
        api_key (`str`, *optional*): its API key.
        timeout (`float`): seconds one request may take.
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 240.0):
        self.client = ServerClient(url, api_key=api_key, timeout=timeout)

    def completion_logps(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, temperature: float = 1.0
    ) -> torch.Tensor:
        """Same contract as `algo.logprobs.completion_logps`: rows `[B, P+T]` (prompt left-padded, completion
        right-padded, `attention_mask` marking real tokens), `T = logits_to_keep`. Returns `[B, T]` float32 logps,
        0 at padded completion positions."""
        T = logits_to_keep
        real = attention_mask.bool().cpu()
        ids = input_ids.cpu()
        seqs = []
        for row, keep in zip(ids, real, strict=True):
            seqs.append({"prompt_ids": row[:-T][keep[:-T]].tolist(), "completion_ids": row[-T:][keep[-T:]].tolist()})
        answer = self.client.post("/ws/logprobs", {"sequences": seqs, "temperature": float(temperature)})
        got = answer.get("logprobs") if isinstance(answer, dict) else None
        if not isinstance(got, list) or len(got) != len(seqs):
            raise RuntimeError(f"reference server {self.client.url} answered {str(answer)[:200]!r} to /ws/logprobs")
        out = torch.zeros(len(seqs), T, dtype=torch.float32)  # [B, T]
        for i, (s, lps) in enumerate(zip(seqs, got, strict=True)):
            if len(lps) != len(s["completion_ids"]):
                raise RuntimeError(
                    f"reference server {self.client.url} returned {len(lps)} logprobs for a completion of "
                    f"{len(s['completion_ids'])} tokens"
                )
            cols = real[i, -T:].nonzero().squeeze(-1)  # [n] columns of the real completion tokens
            out[i, cols] = torch.tensor(lps, dtype=torch.float32)
        return out

    def close(self) -> None:
        self.client.close()
