"""Test and bench tooling (not in the wheel): processes and 2-rank runs forked from a warm interpreter
(`warm_launch`), the fork server's heap freeze (`frozen_heap`) and vLLM's compiled token-rank helper run eagerly
in its forks (`eager_compile`), and `json_records` (the `TAG {...}` records of processes sharing one pipe). Tests
import it as `support` (pytest puts `tests/` on the path); the benches put `tests/` on their path first
(`bench/_runs.py`)."""

from __future__ import annotations


def json_records(text: str, tag: str) -> list[dict]:
    """The JSON objects printed as `TAG {...}` in the output of processes that share one pipe, in order. Processes
    writing to one pipe unbuffered (`PYTHONUNBUFFERED`, as `make` sets it) interleave: `print` writes a line's text and
    its newline in two writes, so another process's text can land before or after a record on the same line (`to
    stderr tooRUN {...}`, `RESULT {...}RESULT {...}`, both seen under `accelerate launch`); each record is read from
    its `TAG {` to the end of its JSON object.

    Example:
        >>> json_records('x RUN {"a": 1}RUN {"a": 2}\\nRUN {"b": [3]} tail', "RUN")
        [{'a': 1}, {'a': 2}, {'b': [3]}]
    """
    import json

    decoder, marker, records = json.JSONDecoder(), f"{tag} {{", []
    for line in text.splitlines():
        at = line.find(marker)
        while at >= 0:
            record, end = decoder.raw_decode(line, at + len(tag) + 1)
            records.append(record)
            at = line.find(marker, end)
    return records
