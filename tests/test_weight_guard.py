"""The stale-weight guard counts K/V projection weights by content: offloading that replaces Parameter objects
(accelerate's sequential CPU offload) or swaps tensors (torch.utils.swap_tensors, as diffusers' group offloading
moves torchao weights) keeps a filled cache usable, and every real edit of a K/V weight is still refused, on each
route. The rollouts compare against the masked full-sequence stock forward of the same weights."""

import pytest
import torch
from accelerate import cpu_offload
from helpers import causal_outputs, conditioning, forward, masked_outputs, tiny_wan

from diffusers_causal_kv import CausalWanAttnProcessor
from diffusers_causal_kv.model.topology import projection_state

H = W = 4
STALE = "K/V projection weights changed since cache tag 'pos' was filled"


def _setup():
    model = tiny_wan()
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, 16, 1, H, W, generator=g) for _ in range(3)]
    return model, text, chunks


def _assert_rollout_matches(model, text, chunks, reference):
    for out, ref in zip(causal_outputs(model, text, chunks), reference, strict=True):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def _assert_edit_refused(model, text, chunks, edit):
    """Fill two chunks, apply ``edit``, run a stock forward (which runs the offloading hooks), then the next cached
    forward must refuse the stale cache."""
    causal_outputs(model, text, chunks[:2])
    edit()
    forward(model, chunks[0], torch.zeros(2), text)
    with pytest.raises(RuntimeError, match=STALE):
        forward(model, chunks[2], torch.zeros(2), text, start_frame=2)


def _replacing_hook(module, args):
    # What accelerate's hooks do on every forward: a new Parameter object of the same values.
    for name, param in list(module._parameters.items()):
        module._parameters[name] = torch.nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)


def _swapping_hook(module, args):
    # What diffusers' group offloading does to torchao weights: exchange the tensors (the version counter restarts).
    for param in module._parameters.values():
        torch.utils.swap_tensors(param, torch.nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))


def _kv_linears(model):
    return [attn.to_k for block in model.blocks for attn in (block.attn1, block.attn2)]


@pytest.mark.parametrize("hook", [_replacing_hook, _swapping_hook], ids=["replaced_parameters", "swapped_tensors"])
def test_parameters_replaced_or_swapped_each_forward(hook):
    model, text, chunks = _setup()
    reference = masked_outputs(model, text, chunks)
    for linear in _kv_linears(model):
        linear.register_forward_pre_hook(hook)
    _assert_rollout_matches(model, text, chunks, reference)
    weight = model.blocks[1].attn2.to_k.weight
    version = weight._version

    def edit():
        with torch.no_grad():
            model.blocks[1].attn2.to_k.weight.add_(1e-3)

    _assert_edit_refused(model, text, chunks, edit)
    if hook is _swapping_hook:  # the edit's version bump was undone by the swaps: only the content tells
        assert model.blocks[1].attn2.to_k.weight is weight and weight._version <= version + 1


def test_sequential_cpu_offload():
    """accelerate's cpu_offload (what enable_sequential_cpu_offload runs) leaves meta placeholders and loads a new
    Parameter on every forward: the guard reads the offloaded copies the forward loads."""
    model, text, chunks = _setup()
    reference = masked_outputs(model, text, chunks)
    cpu_offload(model, execution_device=torch.device("cpu"))
    assert model.blocks[0].attn1.to_k.weight.is_meta
    _assert_rollout_matches(model, text, chunks, reference)

    offloaded = model.blocks[0].attn1.to_v._hf_hook.weights_map

    def in_place():
        with torch.no_grad():
            offloaded["weight"].mul_(1.01)

    _assert_edit_refused(model, text, chunks, in_place)

    def assigned():  # another tensor of other values where the offloaded copies live
        key = offloaded.prefix + "bias"
        offloaded.dataset[key] = offloaded.dataset[key] + 1e-3

    _assert_edit_refused(model, text, chunks, assigned)


@pytest.mark.parametrize("route", ["in_place", "assigned_parameter", "load_state_dict", "last_bit"])
def test_every_edit_of_a_kv_weight_is_refused(route):
    model, text, chunks = _setup()
    attn = model.blocks[0].attn1

    def edit():
        if route == "in_place":
            with torch.no_grad():
                attn.norm_k.weight.mul_(1.5)
        elif route == "assigned_parameter":
            attn.to_v.weight = torch.nn.Parameter(attn.to_v.weight.detach() * 1.01)
        elif route == "load_state_dict":
            state = model.state_dict()
            state["blocks.0.attn1.to_k.bias"] = state["blocks.0.attn1.to_k.bias"] + 1.0
            model.load_state_dict(state)
        else:  # one element's last bit
            with torch.no_grad():
                flat = attn.to_k.weight.view(-1)
                flat[7] = torch.nextafter(flat[7], torch.tensor(float("inf")))

    _assert_edit_refused(model, text, chunks, edit)


def test_an_equal_parameter_or_a_move_is_no_edit():
    model, text, chunks = _setup()
    reference = masked_outputs(model, text, chunks)
    causal_outputs(model, text, chunks[:2])
    state = projection_state(model)
    attn = model.blocks[1].attn1
    attn.to_k.weight = torch.nn.Parameter(attn.to_k.weight.detach().clone())
    model.to(torch.device("cpu"))  # a no-op move
    assert projection_state(model) == state
    forward(model, chunks[2], torch.zeros(2), text, start_frame=2, store_kv=True)
    _assert_rollout_matches(model, text, chunks, reference)
