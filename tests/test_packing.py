"""Padding-free packing (`grpo_async.algo.packing`): hand-worked packing, isolation of packed rows on CPU with the
default attention implementations, and packed logps/gradients equal to the padded path's."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_async.algo.logprobs import completion_logps, score_tokens
from grpo_async.algo.packing import (
    check_isolation,
    first_fit_decreasing,
    fit_bins,
    pack_rows,
    packed_positions,
    packed_token_scores,
    unpack_completion,
)


def test_pack_rows_hand_worked():
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 3, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    p = pack_rows(ids, mask, logits_to_keep=2, capacity=6)  # both rows in one bin
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 3]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert p.keep.tolist() == [0, 1, 4]  # the positions before 6, 7 (row 0) and 3 (row 1)
    assert (p.logits_bin.tolist(), p.logits_pos.tolist()) == ([0, 0, 0], [0, 1, 2])
    assert p.target_ids.tolist() == [6, 7, 3]
    assert (p.rows.tolist(), p.cols.tolist()) == ([0, 0, 1], [0, 1, 0])
    back = unpack_completion(torch.tensor([1.0, 2.0, 3.0]), p, fill=-1.0)
    assert back.tolist() == [[1.0, 2.0], [3.0, -1.0]]
    # default capacity = the longest row (3 tokens): one row per bin
    p = pack_rows(ids, mask, logits_to_keep=2)
    assert p.input_ids.tolist() == [[5, 6, 7], [8, 9, 3]]
    assert p.position_ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert p.keep.tolist() == [0, 1]
    assert (p.logits_bin.tolist(), p.logits_pos.tolist()) == ([0, 0, 1], [0, 1, 1])


def test_first_fit_decreasing_hand_worked():
    assert first_fit_decreasing([3, 5, 2, 4], 5) == ([2, 0, 2, 1], [0, 0, 3, 0], [5, 4, 5])
    assert first_fit_decreasing([2, 2, 2], 6) == ([0, 0, 0], [0, 2, 4], [6])
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([7], 6)


def test_fit_bins_widen_the_bins_only_past_max_positions():
    # bins of the longest (10): [10] [6] [6] [6] = 40 positions
    assert packed_positions([10, 6, 6, 6]) == 40 and packed_positions([]) == 0
    assert fit_bins([10, 6, 6, 6]) == fit_bins([10, 6, 6, 6], 40) == first_fit_decreasing([10, 6, 6, 6], 10)
    # 28: k = 2 bins of 14 need 3 ([10] [6 6] [6]); k = 1, one bin of 28, fits
    assert fit_bins([10, 6, 6, 6], 28) == ([0, 0, 0, 0], [0, 10, 16, 22], [28])
    # 36: k = 3 bins of 12 hold [10] [6 6] [6] → 3 × 12 = 36
    assert fit_bins([10, 6, 6, 6], 36) == ([0, 1, 1, 2], [0, 0, 6, 0], [10, 12, 6])
    with pytest.raises(ValueError, match="28 tokens do not fit in a forward pass of at most 27 positions"):
        fit_bins([10, 6, 6, 6], 27)


def test_pack_rows_within_max_positions():
    T = 9
    lengths = [10, 6, 6, 6]  # prompt 1 + completion
    ids = torch.zeros(4, 1 + T, dtype=torch.long)
    mask = torch.zeros(4, 1 + T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        ids[i, :n] = torch.arange(10 * (i + 1), 10 * (i + 1) + n)
    assert pack_rows(ids, mask, T).input_ids.shape == (4, 10)  # 40 positions
    p = pack_rows(ids, mask, T, max_positions=36)  # [10] [6 6] [6 + filler 6]
    assert p.input_ids.shape == (3, 12)
    assert p.position_ids.tolist()[1] == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    assert p.position_ids.tolist()[2] == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]  # filler restarts at 0
    assert p.real.sum().item() == 28
    with pytest.raises(ValueError, match="capacity or max_positions"):
        pack_rows(ids, mask, T, capacity=12, max_positions=36)


def test_bins_hold_short_rows_beside_a_long_one_with_filler_segments():
    """Lengths 6, 2, 3, 1 (prompt 1 + completion): capacity 6 → [6] and [3 | 2 | 1]; a bin with room left is filled
    with token 0 at positions 0, 1, ... (a segment of its own)."""
    T = 5
    lengths = [6, 2, 3, 1]
    ids = torch.zeros(4, 1 + T, dtype=torch.long)
    mask = torch.zeros(4, 1 + T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        ids[i, :n] = torch.arange(10 * (i + 1), 10 * (i + 1) + n)
    p = pack_rows(ids, mask, T)
    assert p.input_ids.tolist() == [[10, 11, 12, 13, 14, 15], [30, 31, 32, 20, 21, 40]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 0]]
    p = pack_rows(ids[1:], mask[1:], T)  # lengths 2, 3, 1, capacity 3 (the longest): [3], [2 | 1]
    assert p.input_ids.tolist() == [[30, 31, 32], [20, 21, 40]]
    p = pack_rows(ids[1:3], mask[1:3], T, capacity=6)  # [3 | 2]: as wide as the fullest bin, no filler
    assert p.input_ids.tolist() == [[30, 31, 32, 20, 21]]
    p = pack_rows(ids[[0, 3]], mask[[0, 3]], T, capacity=8)  # [6 | 1] + nothing: fill is exactly 7
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0]]
    p = pack_rows(ids[[1, 3]], mask[[1, 3]], T, capacity=2)  # [2], [1 + filler 0]
    assert p.input_ids.tolist() == [[20, 21], [40, 0]]
    assert p.position_ids.tolist() == [[0, 1], [0, 0]]


def test_pack_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="same"):
        pack_rows(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3), 2)
    with pytest.raises(ValueError, match="logits_to_keep"):
        pack_rows(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4), 4)
    with pytest.raises(ValueError, match="no real token before"):  # row 0: empty prompt
        pack_rows(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]), 2)


def _rows(seed=0, B=5, P=7, T=9, vocab=60):
    """Left-padded prompts and right-padded completions of skewed lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, vocab, (B, P + T), generator=g)
    mask = torch.zeros(B, P + T, dtype=torch.long)
    for i in range(B):
        p = 1 + (i * 3) % P  # prompt length 1..P
        t = 1 + (i * 5) % T  # completion length 1..T
        mask[i, P - p : P + t] = 1
    ids = ids.masked_fill(mask == 0, 0)  # pad id
    return ids, mask


def _alone(model, ids, mask, T, temperature):
    """Each row run by itself with its padding removed: the ground truth. Returns `[B, T]` (0 at padding)."""
    out = torch.zeros(ids.size(0), T, dtype=torch.float64)
    for i in range(ids.size(0)):
        real = mask[i].bool()
        row = ids[i][real].unsqueeze(0)  # [1, L]
        n = int(mask[i, -T:].sum())  # completion tokens
        logits = model(input_ids=row, use_cache=False).logits[0, -n - 1 : -1] / temperature  # [n, V]
        out[i, :n] = torch.log_softmax(logits, -1).gather(-1, row[0, -n:].unsqueeze(-1)).squeeze(-1)
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logps_equal_each_row_alone(tiny_model_path, attn):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64, attn_implementation=attn)
    model.eval()
    ids, mask = _rows()
    T = 9
    with torch.no_grad():
        check_isolation(model)
        truth = _alone(model, ids, mask, T, temperature=0.7)
        packed = completion_logps(model, ids, mask, T, temperature=0.7, padding_free=True)
        packed_chunks = completion_logps(model, ids, mask, T, temperature=0.7, batch_size=2, padding_free=True)
        padded = completion_logps(model, ids, mask, T, temperature=0.7)
        shared = pack_rows(ids, mask, T, capacity=64)  # every row in one bin: isolation by position ids alone
        one_bin = unpack_completion(packed_token_scores(model, shared, temperature=0.7)[0], shared)
    assert shared.input_ids.size(0) == 1
    cm = mask[:, -T:].bool()
    assert (packed - truth).abs().max().item() <= 1e-6
    assert (one_bin - truth).abs().max().item() <= 1e-6
    assert (packed_chunks - truth).abs().max().item() <= 1e-6
    if attn == "sdpa":  # (transformers' eager attention gives NaN for left-padded rows in float64; packing has none)
        assert (padded[cm] - truth[cm]).abs().max().item() <= 1e-6  # the padded path agrees on real tokens
    assert (packed[~cm] == 0).all()


def test_packed_gradients_equal_padded(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64)
    ids, mask = _rows(seed=1)
    T = 9
    cm = mask[:, -T:].to(torch.float64)
    grads = []
    for padding_free in (False, True, "one bin"):
        model.zero_grad()
        if padding_free == "one bin":
            packed = pack_rows(ids, mask, T, capacity=64)
            logps = unpack_completion(packed_token_scores(model, packed)[0], packed)
        else:
            logps = completion_logps(model, ids, mask, T, padding_free=padding_free)
        ((logps * cm).sum() / cm.sum()).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert (grads[0] - grads[1]).abs().max().item() <= 1e-10
    assert (grads[0] - grads[2]).abs().max().item() <= 1e-10


def _graph_ops(tensor) -> set[str]:
    """The names of the autograd nodes `tensor` was computed through."""
    seen, todo, names = set(), [tensor.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [next_fn for next_fn, _ in node.next_functions]
    return names


@pytest.mark.parametrize("padding_free", [False, True])
def test_temperature_one_scores_the_logits_as_they_are(tiny_model_path, padding_free):
    """At temperature 1 (TRL's default) the trainer's log-probs and entropies come from the model's logits as they
    are: no division (a logits-sized copy, a pass forward and one backward; dividing by 1 is exact, so the values
    are those of dividing by 1); at any other temperature the logits are divided."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids, mask = _rows(seed=2)
    T = 9
    kw = dict(entropy=True, padding_free=padding_free)
    one = score_tokens(model, ids, mask, T, temperature=1.0, entropy_grad=True, **kw)
    assert "DivBackward0" not in _graph_ops(one.logps) | _graph_ops(one.entropies)
    hot = score_tokens(model, ids, mask, T, temperature=0.7, **kw)
    assert "DivBackward0" in _graph_ops(hot.logps)
    with torch.no_grad():  # the same numbers as dividing by 1
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        logits = out.logits[:, -T - 1 : -1] / 1.0  # [B, T, V]
        truth = torch.log_softmax(logits, -1).gather(-1, ids[:, -T:].unsqueeze(-1)).squeeze(-1)
    cm = mask[:, -T:].bool()
    assert (one.logps[cm] - truth[cm]).abs().max().item() <= 1e-5


class _DropsPositions(torch.nn.Module):
    """Fault injection: a model whose forward ignores position ids, so packed rows are not isolated."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, position_ids=None, **kwargs):
        return self.model(**kwargs)


def test_check_isolation_refuses_a_model_that_mixes_packed_rows(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="GRPOConfig.padding_free"):
        check_isolation(_DropsPositions(model))
    # and the leak is real: packed logps then differ from the rows alone
    ids, mask = _rows()
    with torch.no_grad():
        packed = pack_rows(ids, mask, 9, capacity=64)  # all rows in one bin
        leaky = unpack_completion(packed_token_scores(_DropsPositions(model), packed)[0], packed)
        truth = _alone(model, ids, mask, 9, temperature=1.0)
    assert (leaky.double() - truth).abs().max().item() > 1e-3


def test_empty_completions_give_zeros_and_a_working_backward(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids = torch.tensor([[0, 5, 6, 0, 0], [7, 8, 9, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 0, 0]])  # no completion token in either row
    out = completion_logps(model, ids, mask, 2, padding_free=True)
    assert out.shape == (2, 2) and (out == 0).all()
    out.sum().backward()  # the loss of a micro-batch with nothing to train still backpropagates (zero gradients)
