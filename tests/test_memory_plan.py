"""The memory plan against what real objects hold on small shapes on CPU: weights and KV cache bytes exactly (the
model's parameters, the engines' ``memory_bytes()`` after a rollout), the activations of one chunk forward within
its stated margin of the live tensor bytes measured during the forward (never below, at most 1.6x above)."""

import weakref

import pytest
import torch
from helpers import conditioning, tiny_wan
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from diffusers_causal_kv import CausalContext, CausalWanAttnProcessor, RollingKVCacheEngine, VanillaKVCacheEngine
from diffusers_causal_kv.memory_plan import main, memory_plan

ACTIVATION_MARGIN = 1.6


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of the storages created inside the mode and still alive."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._held = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()  # a view's storage is its input's: not new memory
                if storage.data_ptr() not in self._held | inputs and storage.nbytes():
                    self._add(storage)
        return out

    def _add(self, storage):
        key, size = storage.data_ptr(), storage.nbytes()
        self._held.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)

        def free():
            self.live -= size
            self._held.discard(key)

        weakref.finalize(storage, free)


def _config(model) -> dict:
    return {k: v for k, v in model.config.items() if not k.startswith("_")}


def _run(model, text, latent_frames, chunk, tags, measure_at=None):
    """Commit chunks of ``chunk`` latent frames on ``tags``; the live-bytes peak of the denoising forward of the
    chunk starting at ``measure_at``."""
    batch = text.shape[0]
    text = text.repeat(len(tags), 1, 1)
    peak = None
    for start in range(0, latent_frames, chunk):
        x = torch.randn(batch * len(tags), 16, chunk, 8, 8)
        t = torch.zeros(batch * len(tags))
        with torch.no_grad():
            if start == measure_at:
                with CausalContext(model, start_frame=start, cache_tag=tags), _LiveBytes() as live:
                    model(hidden_states=x, timestep=t + 500, encoder_hidden_states=text, return_dict=False)
                peak = live.peak
            with CausalContext(model, start_frame=start, cache_tag=tags, store_kv=True):
                model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)
    return peak


@pytest.mark.parametrize("window, cache_dtype, guidance", [
    (5, "fp8", 1.0),
    pytest.param(None, "fp32", 1.0, marks=pytest.mark.slow),
    pytest.param(None, "fp8", 5.0, marks=pytest.mark.slow),
    pytest.param(4, "fp32", 5.0, marks=pytest.mark.slow),
])
def test_cache_and_weights_exact_activations_within_margin(window, cache_dtype, guidance):
    model = tiny_wan(head_dim=32, heads=2)
    model.set_attn_processor(CausalWanAttnProcessor())
    kv_dtype = torch.float8_e4m3fn if cache_dtype == "fp8" else None
    model.kv_cache_engines = {"main": VanillaKVCacheEngine(kv_dtype=kv_dtype) if window is None
                              else RollingKVCacheEngine(window, kv_dtype=kv_dtype)}
    text, _ = conditioning(model, batch=1)
    tags = ("pos", "neg") if guidance > 1 else ("pos",)
    latent_frames, chunk = 6, 2
    peak = _run(model, text, latent_frames, chunk, tags, measure_at=latent_frames - chunk)
    plan = memory_plan(_config(model), height=64, width=64, num_frames=4 * (latent_frames - 1) + 1,
                       chunk_frames=chunk, window_frames=window, guidance_scale=guidance, weights="bf16",
                       cache_dtype=cache_dtype, compute_dtype="fp32", text_len=text.shape[1])
    engine = model.kv_cache_engines["main"]
    assert plan.self_cache + plan.cross_cache == engine.memory_bytes()
    assert peak <= plan.activations <= ACTIVATION_MARGIN * peak, (peak, plan.activations)


def test_weight_bytes_exact():
    model = tiny_wan(head_dim=32, heads=2).to(torch.bfloat16)
    plan = memory_plan(_config(model), height=64, width=64, weights="bf16")
    keep = model._keep_in_fp32_modules
    expected = sum(p.numel() * (4 if any(part in keep for part in name.split(".")) else 2)
                   for name, p in model.named_parameters())
    assert plan.weights == expected


def test_presets_formats_and_refusals(capsys):
    bf16 = memory_plan("wan2.1-14b", weights="bf16")
    fp8 = memory_plan("wan2.1-14b", weights="fp8", cache_dtype="fp8", window_frames=10)
    assert fp8.weights < 0.55 * bf16.weights and fp8.self_cache < 0.3 * bf16.self_cache
    two = memory_plan("wan2.2-a14b", weights="fp8")
    assert two.weights == 2 * memory_plan("wan2.1-14b", weights="fp8").weights
    assert memory_plan("wan2.2-a14b", weights="fp8", offload="model").weights * 2 == two.weights
    assert memory_plan("wan2.1-14b", context_parallel=2).self_cache * 2 == bf16.self_cache
    with pytest.raises(ValueError, match="nvfp4"):
        memory_plan("wan2.1-14b", weights="nvfp4")
    assert main(["wan2.1-1.3b", "--weights", "gguf-q4_k", "--window-frames", "7", "--budget-gib", "8"]) == 0
    assert "\nfits in 8 GiB" in capsys.readouterr().out
    assert main(["wan2.1-14b", "--budget-gib", "24"]) == 0
    assert "does not fit in 24 GiB" in capsys.readouterr().out
    assert main(["wan2.1-1.3b", "--weights", "nvfp4"]) == 1
