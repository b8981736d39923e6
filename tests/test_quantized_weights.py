"""Quantized transformers with the causal processors, each loaded the way users load them (a GGUF file in the
original Wan key layout through ``from_single_file``, torchao and optimum-quanto through ``from_pretrained`` with
diffusers' configs): the cached rollout equals the masked full-sequence forward of the same quantized model, and the
stale-weight guard refuses a cache after an edit of a quantized K/V weight. bitsandbytes needs CUDA."""

import gguf
import numpy as np
import pytest
import torch
from diffusers import GGUFQuantizationConfig, QuantoConfig, TorchAoConfig, WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from helpers import causal_outputs, conditioning, forward, masked_outputs, tiny_wan
from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

from diffusers_causal_kv import CausalWanAttnProcessor

STALE = "K/V projection weights changed since cache tag 'pos' was filled"
# Inner dim 32 holds whole quantization blocks of GGUF's Q8_0/Q4_0 (32 values); K-quants and quanto's int4 group
# 256 and 128 values: dim 256 for them.
SMALL, WIDE = 16, 128
# fp32 compute over dequantized weights; the masked reference multiplies other shapes, so sums run in another order.
TOLERANCE = dict(rtol=1e-5, atol=5e-5)

# diffusers' names -> the original Wan checkpoint's (the inverse of diffusers' single-file converter).
_ORIGINAL_NAMES = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"), ("attn1", "self_attn"), ("attn2", "cross_attn"),
    (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."), ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"), ("proj_out", "head.head"), (".norm2.", ".norm3."),
]


def _original_key(key: str) -> str:
    for diffusers_name, original in _ORIGINAL_NAMES:
        key = key.replace(diffusers_name, original)
    return "head.modulation" if key == "scale_shift_table" else key.replace(".scale_shift_table", ".modulation")


def _write_gguf(model, path, qtype: gguf.GGMLQuantizationType) -> None:
    """Write ``model``'s weights as an original-layout Wan GGUF file: each 2-D weight whose rows hold whole
    quantization blocks in ``qtype``, the rest in F32. gguf cannot quantize to K-quants: their blocks are written
    from random bytes with small scales (any such bytes are valid Q4_K data), so the file still is a real Q4_K file."""
    state = {_original_key(k): v.float().numpy() for k, v in model.state_dict().items()}
    assert set(convert_wan_transformer_to_diffusers(dict(state))) == set(model.state_dict())
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch="wan")
    for key, array in state.items():
        if array.ndim != 2 or array.shape[-1] % block:
            writer.add_tensor(key, array)
        elif qtype == gguf.GGMLQuantizationType.Q4_K:
            blocks = rng.integers(0, 256, (array.shape[0], array.shape[1] // block, block_bytes), dtype=np.uint8)
            blocks[..., :4] = np.array([2e-3, 1e-3], dtype=np.float16).view(np.uint8)  # d and dmin
            writer.add_tensor(key, blocks.reshape(array.shape[0], -1), raw_dtype=qtype)
        else:
            writer.add_tensor(key, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_model(tmp_path, qtype):
    model = tiny_wan(head_dim=WIDE if qtype == gguf.GGMLQuantizationType.Q4_K else SMALL)
    _write_gguf(model, tmp_path / "wan.gguf", qtype)
    model.save_config(tmp_path / "config")
    return WanTransformer3DModel.from_single_file(
        str(tmp_path / "wan.gguf"), config=str(tmp_path / "config"), torch_dtype=torch.float32,
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32))


def _pretrained_model(tmp_path, quantization_config, head_dim=SMALL):
    tiny_wan(head_dim=head_dim).save_pretrained(tmp_path / "model")
    return WanTransformer3DModel.from_pretrained(tmp_path / "model", quantization_config=quantization_config,
                                                 torch_dtype=torch.float32)


def _first_plain_tensor(tensor):
    """The first inner tensor of a quantized weight (torchao, quanto), or the weight (GGUF's uint8 blocks)."""
    while hasattr(tensor, "__tensor_flatten__"):
        tensor = getattr(tensor, tensor.__tensor_flatten__()[0][0])
    return tensor.as_subclass(torch.Tensor)  # GGUF's parameter class would wrap the edit's intermediate results


def _check_route(model, kind):
    model.set_attn_processor(CausalWanAttnProcessor())
    weight = model.blocks[1].attn1.to_k.weight
    assert kind in type(weight).__name__  # the K/V projections are quantized
    text, _ = conditioning(model)
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, 16, 1, 4, 4, generator=g) for _ in range(3)]
    for out, ref in zip(causal_outputs(model, text, chunks), masked_outputs(model, text, chunks), strict=True):
        torch.testing.assert_close(out, ref, **TOLERANCE)

    causal_outputs(model, text, chunks[:2])
    with torch.no_grad():
        _first_plain_tensor(weight).view(torch.uint8).view(-1)[5] += 1  # one byte of one quantized value
    forward(model, chunks[0], torch.zeros(2), text)
    with pytest.raises(RuntimeError, match=STALE):
        forward(model, chunks[2], torch.zeros(2), text, start_frame=2)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K"])
def test_gguf_from_single_file(qtype, tmp_path):
    _check_route(_gguf_model(tmp_path, gguf.GGMLQuantizationType[qtype]), "GGUF")


@pytest.mark.parametrize("config", [Int8WeightOnlyConfig, Float8WeightOnlyConfig], ids=["int8", "float8"])
def test_torchao_weight_only(config, tmp_path):
    _check_route(_pretrained_model(tmp_path, TorchAoConfig(config())), "Tensor")


def test_torchao_under_leaf_level_group_offloading(tmp_path):
    model = _pretrained_model(tmp_path, TorchAoConfig(Int8WeightOnlyConfig()))
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    forward(model, torch.zeros(2, 16, 1, 4, 4), torch.zeros(2), text, start_frame=0)
    model.enable_group_offload(onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                               offload_type="leaf_level")
    _check_route(model, "Tensor")


def test_quanto_int8(tmp_path):
    _check_route(_pretrained_model(tmp_path, QuantoConfig(weights_dtype="int8")), "QBytes")


@pytest.fixture
def quanto_python_unpack():
    """quanto's CPU kernel for unpacking int4 weights is a C++ extension compiled on their first use (over 13 minutes
    on two cores): register the op's plain torch definition for CPU instead, for this test (the values of each byte,
    low bits first, concatenated along the first axis, as quanto packs them)."""

    def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
        mask = (1 << bits) - 1
        return torch.cat([(packed >> shift) & mask for shift in range(0, 8, bits)]).to(torch.uint8)

    library = torch.library.Library("quanto", "IMPL")
    library.impl("unpack", unpack, "CPU")
    yield
    library._destroy()


def test_quanto_int4(quanto_python_unpack, tmp_path):
    _check_route(_pretrained_model(tmp_path, QuantoConfig(weights_dtype="int4"), head_dim=WIDE), "QBits")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bitsandbytes through diffusers' BitsAndBytesConfig "
                    "needs CUDA: its 8-bit and 4-bit layers have no CPU path; benchmarks/gpu_check.py runs it on a GPU")
def test_bitsandbytes(tmp_path):
    from diffusers import BitsAndBytesConfig

    model = _pretrained_model(tmp_path, BitsAndBytesConfig(load_in_8bit=True)).cuda()
    _check_route(model, "Int8Params")
