"""`PolicyPublisher`: weights stream from the live model into the sampler, group by group, without a staged copy."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_async.generation.shared import SharedBackend
from grpo_async.pipeline.publisher import PolicyPublisher


class Receiver:
    """A sampler that records what `load_weights` is handed (storage pointers, devices, group sizes) and copies the
    tensors into its own model, as every backend does."""

    def __init__(self, model):
        self.params = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.version, self.ptrs, self.devices, self.groups = None, {}, set(), []

    def load_weights(self, groups, version):
        for module, tensors in groups:
            self.groups.append((module, [n for n, _ in tensors]))
            for name, t in tensors:
                self.ptrs[name] = t.untyped_storage().data_ptr()
                self.devices.add(t.device.type)
                self.params[name].copy_(t)
        self.version = version

    def close(self):
        pass


def _model(path, device="cpu"):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


def test_publish_hands_over_views_of_the_live_parameters_module_by_module(tiny_model_path):
    model = _model(tiny_model_path)
    receiver = Receiver(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # new weights after an optimizer step
    publisher = PolicyPublisher(SharedBackend(lambda: receiver))
    assert publisher.publish(model, version=3) > 0
    live = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    assert receiver.ptrs == live  # the live tensors themselves: no staged copy of the model
    assert all(torch.equal(receiver.params[n], p) for n, p in model.named_parameters())
    assert receiver.version == 3 and publisher.published == 3
    # one group per module, in model order, every parameter exactly once
    assert [n for _, names in receiver.groups for n in names] == [n for n, _ in model.named_parameters()]
    assert all(all(n.startswith(module + ".") for n in names) for module, names in receiver.groups)
    assert publisher.publish(model, version=3) == 0.0  # unchanged version: nothing sent


def test_disabled_publisher_sends_nothing(tiny_model_path):
    model = _model(tiny_model_path)
    receiver = Receiver(model)
    publisher = PolicyPublisher(SharedBackend(lambda: receiver), enabled=False)
    assert publisher.publish(model, version=1) == 0.0 and receiver.version is None


def test_peft_publishes_merged_weights_under_base_names(tiny_model_path):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)  # non-zero adapters from the start
    model = get_peft_model(_model(tiny_model_path), lora)
    receiver = Receiver(_model(tiny_model_path))
    PolicyPublisher(SharedBackend(lambda: receiver)).publish(model, version=1)
    merged = model.merge_and_unload()
    for name, p in merged.named_parameters():
        torch.testing.assert_close(receiver.params[name], p.detach(), atol=1e-6, rtol=0)
    assert not any("lora" in n for n in receiver.ptrs)


@pytest.mark.gpu
def test_publish_from_a_cuda_model_stays_on_the_device(tiny_model_path):  # pragma: no cover - needs a GPU
    """On a GPU the publish path hands CUDA tensors to the sampler (no copy through host memory) and allocates
    almost nothing beyond the model."""
    model = _model(tiny_model_path, "cuda")
    receiver = Receiver(model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    PolicyPublisher(SharedBackend(lambda: receiver)).publish(model, version=1)
    torch.cuda.synchronize()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert receiver.devices == {"cuda"}
    assert torch.cuda.max_memory_allocated() - before <= 0.25 * model_bytes
