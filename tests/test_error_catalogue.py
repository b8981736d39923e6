"""The error catalogue (the docs' error page, ``docs/errors.md``): every row is triggered here by a real misuse, and
the cache is checked unchanged afterwards. The table, these cases and the package's ``raise`` statements cannot drift
apart: every message fragment of the table has a case and every case's fragment is in the table, and every ``raise``
with a message in the package contains a fragment of its row."""

from __future__ import annotations

import ast
import copy
import pathlib
import re
from unittest import mock

import pytest
import torch
from diffusers import ContextParallelConfig, FlowMatchEulerDiscreteScheduler, ParallelConfig
from diffusers.hooks import FirstBlockCacheConfig
from diffusers.hooks.context_parallel import apply_context_parallel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from helpers import VACE_CHANNELS, assert_same_snapshot, cache_snapshot, conditioning, forward, tiny_vace, tiny_wan

from diffusers_causal_kv import (
    CausalContext,
    CausalWanAttnProcessor,
    CFGAcrossRanks,
    KVCacheEngine,
    RollingKVCacheEngine,
    RolloutPlanner,
    StaticKVCacheEngine,
    StreamingRollout,
    block_causal_mask,
    causal_cp_plan,
    causal_rollout,
    clear_caches,
    prefill,
    recache,
    self_forcing_rollout,
    uninstall_causal_kv,
)
from diffusers_causal_kv.model import commits_together

ROOT = pathlib.Path(__file__).resolve().parents[1]
H = W = 4
FRAME_TOKENS = 4
T = torch.full((1,), 500.0)
ZERO = torch.zeros(1)


# ---------------------------------------------------------------------------------------------- small states
def _x(frames, batch=1, h=H, w=W, channels=16, **kwargs):
    return torch.randn(batch, channels, frames, h, w, **kwargs)


def _control(frames):
    return torch.randn(1, VACE_CHANNELS, frames, H, W)


def _installed(model, engines=None):
    if engines is not None:
        model.kv_cache_engines = engines
    model.set_attn_processor(CausalWanAttnProcessor())
    return model


def _t2v(frames=2, engine=None, **config):
    """An installed tiny T2V model whose tag 'pos' holds ``frames`` committed frames (batch 1), and its prompt."""
    model = _installed(tiny_wan(**config), None if engine is None else {"main": engine})
    text, _ = conditioning(model, batch=1)
    for start in range(frames):
        forward(model, _x(1), ZERO, text, start_frame=start, store_kv=True)
    return model, text


def _vace(frames=1, engines=None):
    """An installed tiny VACE model whose tag 'pos' holds ``frames`` committed frames on both branches."""
    model = _installed(tiny_vace(), engines)
    text, _ = conditioning(model, batch=1)
    for start in range(frames):
        forward(model, _x(1), ZERO, text, extra={"control_hidden_states": _control(1)}, start_frame=start,
                store_kv=True)
    return model, text


def _i2v():
    """An installed tiny Wan2.1 I2V model with one committed frame; its prompt, image embeddings and a chunk."""
    model = _installed(tiny_wan(i2v=True))
    text, image = conditioning(model, batch=1)
    x = _x(1, channels=model.config.in_channels)
    forward(model, x, ZERO, text, image, start_frame=0, store_kv=True)
    return model, text, image, x


# ---------------------------------------------------------------------------------------------- the cases
CASES = []


def case(error, fragment, detail=None, cached=True):
    """Register a case: the decorated function builds a state and returns ``(model, trigger)``; ``trigger()`` must
    raise exactly ``error`` with ``fragment`` (the error page row's text) in its message, and ``detail`` (a regex) when
    given. ``cached``: the state holds committed frames (False where no forward can commit anything)."""

    def register(build):
        CASES.append(pytest.param(build, error, fragment, detail, cached, id=build.__name__.replace("_", "-")))
        return build

    return register


# Installation and engine maps
@case(RuntimeError, "has no CausalWanAttnProcessor installed", "before opening a CausalContext")
def not_installed():
    model, text = _t2v()
    model.set_attn_processor(WanAttnProcessor())  # the stock processors back; the engines stay
    return model, lambda: forward(model, _x(1), T, text, start_frame=2)


@case(RuntimeError, "has no CausalWanAttnProcessor installed", "no KV cache to clear")
def clear_caches_not_installed():
    model, _ = _t2v()
    model.set_attn_processor(WanAttnProcessor())
    return model, lambda: clear_caches(model)


@case(RuntimeError, "do not use CausalWanAttnProcessor", "1 of 4 attention modules")
def partially_installed():
    model, text = _t2v()
    model.blocks[1].attn2.set_processor(WanAttnProcessor())
    return model, lambda: forward(model, _x(1), T, text, start_frame=2)


class _OneProcessMesh:
    """A stand-in for the flattened device mesh of a context-parallel config (these checks run before any
    collective, so one process reaches them; tests/test_parallel.py runs the real thing on two)."""

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def get_local_rank(self):
        return 0

    def get_group(self):
        return self


def _fake_parallelism(model, degree=2, plan=None, **config):
    """What ``model.enable_parallelism(config=ContextParallelConfig(...), cp_plan=plan)`` records and registers,
    without a process group (default plan: ``causal_cp_plan(model)``)."""
    cp = ContextParallelConfig(**(config or {"ulysses_degree": degree}))
    cp._flattened_mesh = _OneProcessMesh(degree)
    model._parallel_config = ParallelConfig(context_parallel_config=cp)
    apply_context_parallel(model, cp, causal_cp_plan(model) if plan is None else plan)
    return model


def _parallel_t2v(**parallelism):
    model, text = _t2v()
    return _fake_parallelism(model, **parallelism), text


# Several devices (the checks before any work; tests/test_parallel.py runs two processes)
@case(NotImplementedError, "ring attention")
def context_parallel_ring_attention():
    model, text = _parallel_t2v(ring_degree=2)
    return model, lambda: forward(model, _x(1), T, text, start_frame=2)


@case(ValueError, "is not causal_cp_plan(transformer)")
def context_parallel_with_diffusers_plan():
    model, text = _t2v()
    _fake_parallelism(model, plan=type(model)._cp_plan)
    return model, lambda: forward(model, _x(1), T, text, start_frame=2)


@case(ValueError, "does not divide across", "grid height 2 does not divide across 4")
def context_parallel_rows_not_divisible():
    model, text = _parallel_t2v(degree=4)
    return model, lambda: forward(model, _x(1), T, text, start_frame=2)


@case(ValueError, "per-token timesteps (Wan2.2 TI2V")
def context_parallel_per_token_timesteps():
    model, text = _parallel_t2v()
    return model, lambda: forward(model, _x(1), torch.full((1, FRAME_TOKENS), 500.0), text, start_frame=2)


@case(ValueError, "which context parallelism does not split", "mode='block_causal'")
def context_parallel_mask_mode():
    model, text = _parallel_t2v()
    return model, lambda: forward(model, _x(2), T, text, start_frame=0, mode="block_causal", chunk_frames=1)


@case(ValueError, "needs return_dict=False")
def context_parallel_return_dict():
    model, text = _parallel_t2v()

    def trigger():
        with torch.no_grad(), CausalContext(model, start_frame=2):
            model(hidden_states=_x(1), timestep=T, encoder_hidden_states=text)
    return model, trigger


@case(RuntimeError, "commit refused on every rank")
def commit_refused_by_another_rank():
    """The report of a peer whose commit failed is simulated: the agreement answers "not every rank is ready"."""
    model, text = _t2v()

    def trigger():
        with mock.patch("diffusers_causal_kv.model.forward_pass.agree", return_value=False), \
                commits_together(group=object()):
            forward(model, _x(1), ZERO, text, start_frame=2, store_kv=True)
    return model, trigger


@case(ValueError, "the ranks of a rollout must hold the same",
      r"rank 1 differs from rank 0 in its random generator state \(generator=\)")
def context_parallel_ranks_seeded_apart():
    """A peer seeded by its rank is simulated: the gathered checksums of rank 1 differ in the generator's state."""
    model, text = _parallel_t2v()

    def seeded_apart(local, group):
        theirs = local.clone()
        theirs[1] += 1  # the generator state's checksum
        return [(0, local), (1, theirs)]

    def trigger():
        with mock.patch("diffusers_causal_kv.parallel.gathered_checksums", seeded_apart):
            causal_rollout(model, _x(2), text, chunk_frames=1, timesteps=(1000,), progress=False,
                           generator=torch.Generator().manual_seed(0))
    return model, trigger


@case(ValueError, "needs a process group of exactly 2 ranks", "got 4")
def guidance_across_four_ranks():
    model, _ = _t2v()
    return model, lambda: CFGAcrossRanks(_OneProcessMesh(4))


@case(ValueError, "needs a temporal patch size of 1", cached=False)
def temporal_patch_size():
    model = _installed(tiny_wan(patch_size=(2, 2, 2)), {"main": KVCacheEngine()})
    text, _ = conditioning(model, batch=1)
    return model, lambda: forward(model, _x(2), T, text, start_frame=0)


@case(ValueError, "transformer.kv_cache_engines must be a dict from branch names", r"got \['main', 'vace'\]")
def engine_map_with_unknown_branch():
    model, text = _t2v()
    model.kv_cache_engines["vace"] = KVCacheEngine()  # a T2V model has no VACE branch
    return model, lambda: forward(model, _x(1), T, text, start_frame=2)


@case(ValueError, "cache_engines must map exactly the branches", r"\['main'\] to engines, got \[\]")
def cache_engines_missing_branch():
    model, text = _t2v()
    return model, lambda: forward(model, _x(1), T, text, start_frame=0, cache_engines={})


@case(TypeError, "not a KV-cache engine", "cache_engines\\['main'\\] is a object")
def cache_engines_not_an_engine():
    model, text = _t2v()
    return model, lambda: forward(model, _x(1), T, text, start_frame=0, cache_engines={"main": object()})


@case(ValueError, "each branch needs its own engine instance")
def one_engine_on_two_branches():
    model, text = _vace()
    shared = KVCacheEngine()
    return model, lambda: forward(model, _x(1), T, text, extra={"control_hidden_states": _control(1)},
                                  start_frame=0, cache_engines={"main": shared, "vace": shared})


@case(ValueError, "already registered modules of branch", "branch 'main' already registered modules of branch 'vace'")
def engine_moved_to_another_branch():
    model, text = _vace()
    engines = model.kv_cache_engines
    swapped = {"main": engines["vace"], "vace": engines["main"]}
    return model, lambda: forward(model, _x(1), T, text, extra={"control_hidden_states": _control(1)},
                                  start_frame=1, cache_engines=swapped)


@case(RuntimeError, "is a copy (copy.deepcopy)", "still run the original's forward")
def deepcopy_used_before_its_first_context():
    model, text = _t2v()
    ema = copy.deepcopy(model)
    return model, lambda: forward(ema, _x(1), T, text)


@case(RuntimeError, "is a copy (copy.deepcopy)", r"diffusers hooks \['causal_kv', 'user_hook'\]")
def deepcopy_with_other_hooks():
    from diffusers.hooks import HookRegistry, ModelHook

    model, text = _t2v()
    HookRegistry.check_if_exists_or_initialize(model).register_hook(ModelHook(), "user_hook")
    ema = copy.deepcopy(model)
    return model, lambda: forward(ema, _x(1), T, text, start_frame=0)


@case(ValueError, "holds the cache of another transformer", "give each transformer its own engines")
def engine_shared_by_two_transformers():
    model, text = _t2v()
    other = _installed(tiny_wan(seed=1))
    engines = {"main": model.kv_cache_engines["main"]}
    return model, lambda: forward(other, _x(1), T, text, start_frame=2, cache_engines=engines)


# Context lifecycle and routing
@case(RuntimeError, "This CausalContext is already open")
def context_entered_twice():
    model, _ = _t2v()
    ctx = CausalContext(model, start_frame=2)

    def trigger():
        with ctx:
            ctx.__enter__()

    return model, trigger


@case(RuntimeError, "called inside a CausalContext")
def uninstall_inside_context():
    model, _ = _t2v()

    def trigger():
        with CausalContext(model, start_frame=2):
            uninstall_causal_kv(model)

    return model, trigger


@case(RuntimeError, "needs an open context")
def resolve_outside_context():
    model, _ = _t2v()
    return model, lambda: CausalContext(model, start_frame=2).resolve_registered_engine(model.blocks[0].attn1)


@case(RuntimeError, "registered the attention module")
def module_replaced_under_a_context():
    model, text = _t2v()

    def trigger():
        old = model.blocks[1].attn1
        with torch.no_grad(), CausalContext(model, start_frame=2, store_kv=True):
            # A new module object (no engine registered it) over the same projections, so the weights are not
            # stale: only the routing fails.
            model.blocks[1].attn1 = copy.copy(old)
            try:
                model(hidden_states=_x(1), timestep=ZERO, encoder_hidden_states=text)
            finally:
                model.blocks[1].attn1 = old

    return model, trigger


@case(KeyError, "is not registered with this", "Linear at 0x")
def block_index_of_unregistered_module():
    model, _ = _t2v()
    return model, lambda: model.kv_cache_engines["main"].block_index(torch.nn.Linear(2, 2))


# CausalContext arguments
def _context(**kwargs):
    model, _ = _t2v()
    return model, lambda: CausalContext(model, **kwargs)


@case(TypeError, "start_frame must be an int", "got float")
def start_frame_not_int():
    return _context(start_frame=2.0)


@case(TypeError, "cache_tag must be a str", "got int")
def cache_tag_not_str():
    return _context(cache_tag=1)


@case(ValueError, "names a tag twice", r"\('pos', 'pos'\)")
def batch_of_one_tag_twice():
    return _context(cache_tag=("pos", "pos"))


@case(ValueError, "splits the batch into", "2 equal groups of rows .* has 3 rows")
def batch_of_tags_uneven():
    model, text = _t2v()
    return model, lambda: forward(model, _x(1, batch=3), T.expand(3), text.expand(3, -1, -1), start_frame=2,
                                  cache_tag=("pos", "neg"))


@case(ValueError, "the tags of this batch place the chunk at different RoPE positions", r"'pos': [1-9], 'neg': 0")
def batch_of_tags_at_other_positions():
    model, text = _t2v(4, RollingKVCacheEngine(3, positions="relative"))
    model.kv_cache_engines["main"].skip_to(4, "neg")
    return model, lambda: forward(model, _x(1, batch=2), T.expand(2), text.expand(2, -1, -1), start_frame=4,
                                  cache_tag=("pos", "neg"))


@case(ValueError, "start_frame must be >= 0", "got -1")
def negative_start_frame():
    return _context(start_frame=-1)


@case(ValueError, "mode must be one of", "got 'causal'")
def unknown_mode():
    return _context(mode="causal")


@case(ValueError, "only apply to the mask modes", "^chunk_frames only")
def mask_option_in_cache_mode():
    return _context(chunk_frames=2)


@case(ValueError, "store_kv=True cannot apply")
def store_kv_in_mask_mode():
    return _context(mode="block_causal", chunk_frames=1, store_kv=True)


@case(ValueError, "needs exactly one of chunk_frames")
def mask_mode_without_schedule():
    return _context(mode="block_causal")


@case(ValueError, "are part of a prebuilt mask")
def window_beside_prebuilt_mask():
    return _context(mode="block_causal", mask=block_causal_mask(3, 1, FRAME_TOKENS), window_frames=2)


@case(ValueError, "build it with the", "teacher_forcing_mask")
def mask_of_the_other_mode():
    return _context(mode="teacher_forcing", mask=block_causal_mask(3, 1, FRAME_TOKENS))


# Forward inputs
def _bad_forward(x=None, t=ZERO, text=None, image=None, **ctx):
    """A commit forward of the next chunk on a T2V model holding 2 frames, with one input replaced."""
    model, prompt = _t2v()
    ctx = {"start_frame": 2, "store_kv": True, **ctx}
    return model, lambda: forward(model, _x(1) if x is None else x, t, prompt if text is None else text, image, **ctx)


@case(ValueError, "latent tensor under a CausalContext")
def hidden_states_not_5d():
    return _bad_forward(x=torch.randn(1, 16, H, W))


@case(ValueError, "is not divisible by the patch size", "latent height 5")
def height_not_divisible_by_patch():
    return _bad_forward(x=_x(1, h=5))


@case(TypeError, "timestep must be a tensor", "got float")
def timestep_number():
    return _bad_forward(t=0.0)


@case(ValueError, "per-token timesteps for this chunk only", r"timestep has shape \(1, 3\)")
def timestep_shape():
    return _bad_forward(t=torch.zeros(1, 3))


@case(ValueError, "takes one timestep per sample")
def per_token_timesteps_on_vace():
    model, text = _vace()
    return model, lambda: forward(model, _x(1), torch.zeros(1, FRAME_TOKENS), text,
                                  extra={"control_hidden_states": _control(1)}, start_frame=1)


@case(ValueError, "(the text encoder's output)", r"\[batch, tokens, 32\].*got \(1, 12, 7\)")
def text_embeddings_malformed():
    return _bad_forward(text=torch.randn(1, 12, 7))


@case(ValueError, "encoder_hidden_states has batch", "batch 3 but the latents have batch 1")
def text_embeddings_of_other_batch():
    return _bad_forward(text=torch.randn(3, 12, 32))


@case(ValueError, "drop the image embeddings")
def image_embeddings_for_t2v():
    return _bad_forward(image=torch.randn(1, 4, 8))


@case(ValueError, "pass encoder_hidden_states_image")
def i2v_without_image_embeddings():
    model, text, _, x = _i2v()
    return model, lambda: forward(model, x, ZERO, text, None, start_frame=1, store_kv=True)


@case(ValueError, "(the image encoder's output)", r"got \(1, 4, 4\)")
def i2v_image_embeddings_malformed():
    model, text, image, x = _i2v()
    return model, lambda: forward(model, x, ZERO, text, image[:, :, :4], start_frame=1, store_kv=True)


@case(ValueError, "pad the prompt embeddings to", "has 100")
def i2v_prompt_not_512_tokens():
    model, text, image, x = _i2v()
    return model, lambda: forward(model, x, ZERO, text[:, :100], image, start_frame=1, store_kv=True)


def _bad_control(extra):
    model, text = _vace()
    return model, lambda: forward(model, _x(1), ZERO, text, extra=extra, start_frame=1, store_kv=True)


@case(ValueError, "pass control_hidden_states")
def vace_without_control():
    return _bad_control({})


@case(ValueError, "slice the control latents to the chunk's frames", r"shape \(1, 24, 2, 4, 4\)")
def vace_control_of_other_frames():
    return _bad_control({"control_hidden_states": _control(2)})


@case(ValueError, "one scale per VACE layer", r"shape \(3,\) but the model has 2 VACE layers")
def vace_control_scale_length():
    return _bad_control({"control_hidden_states": _control(1), "control_hidden_states_scale": torch.ones(3)})


@case(ValueError, "build the mask for this sequence", "covers 4 frames of 4 tokens but this forward has 3 frames")
def mask_for_other_sequence():
    return _bad_forward(x=_x(3), t=T, start_frame=0, store_kv=False, mode="block_causal",
                        mask=block_causal_mask(4, 1, FRAME_TOKENS))


@case(ValueError, "halves of equal length", "has 3 latent frames")
def teacher_forcing_odd_frames():
    return _bad_forward(x=_x(3), t=T, start_frame=0, store_kv=False, mode="teacher_forcing", chunk_frames=1)


@case(ValueError, "shorten the rollout", r"frames 2\.\.4 but the RoPE table has 4 positions")
def chunk_past_rope_table():
    model, text = _t2v(rope_max_seq_len=4)
    return model, lambda: forward(model, _x(3), ZERO, text, start_frame=2, store_kv=True)


@case(ValueError, "sampler must be one of", "got 'rolling'")
def rollout_with_an_unknown_sampler():
    model, text = _t2v()
    return model, lambda: causal_rollout(model, _x(2), text, chunk_frames=1, progress=False, sampler="rolling")


@case(ValueError, "scheduler sampling (num_inference_steps) runs every chunk alike")
def rolling_forcing_with_a_scheduler():
    model, text = _t2v()
    return model, lambda: causal_rollout(model, _x(2), text, chunk_frames=1, progress=False,
                                         sampler="rolling_forcing", scheduler=FlowMatchEulerDiscreteScheduler(),
                                         num_inference_steps=2)


@case(ValueError, "runs one list of few-step timesteps for every chunk", "first_chunk_timesteps")
def rolling_forcing_with_first_chunk_timesteps():
    model, text = _t2v()
    return model, lambda: causal_rollout(model, _x(2), text, chunk_frames=1, progress=False,
                                         sampler="rolling_forcing", first_chunk_timesteps=(1000.0,))


@case(NotImplementedError, "runs one timestep per latent frame", "VACE transformer")
def rolling_forcing_on_vace():
    model, text = _vace()
    return model, lambda: causal_rollout(model, _x(2), text, control_latents=_control(2), chunk_frames=1,
                                         progress=False, sampler="rolling_forcing")


@case(ValueError, "build the session with diffusers_causal_kv.make_session()",
      "RolloutSession runs the 'chunkwise' sampler, not 'rolling_forcing'")
def session_of_another_sampler():
    from diffusers_causal_kv.session import RolloutSession, Sampling

    model, text = _t2v()
    planner = RolloutPlanner(model, text)
    return model, lambda: RolloutSession(planner, Sampling.create(sampler="rolling_forcing"), sizes=[1],
                                         latent_shape=(1, 16, H, W))


@case(ValueError, "the rollout covers latent frames", r"frames 2\.\.4 but the RoPE table has 4 positions")
def rollout_past_rope_table():
    model, text = _t2v(rope_max_seq_len=4)
    return model, lambda: causal_rollout(model, _x(3), text, chunk_frames=1, timesteps=(1000,), progress=False,
                                         continue_cache=True)


@case(ValueError, "the rollout covers latent frames", r"frames 0\.\.4 but the RoPE table has 4 positions")
def fresh_rollout_past_rope_table():  # checked before the fresh rollout clears the caches
    model, text = _t2v(rope_max_seq_len=4)
    return model, lambda: causal_rollout(model, _x(5), text, chunk_frames=1, timesteps=(1000,), progress=False)


@case(ValueError, "the rollout covers latent frames", r"frames 0\.\.4 but the RoPE table has 4 positions")
def fresh_self_forcing_rollout_past_rope_table():
    model, text = _t2v(rope_max_seq_len=4)
    return model, lambda: self_forcing_rollout(model, _x(5), text, chunk_frames=1, timesteps=(1000,))


@case(ValueError, "exceeds rope_max_seq_len", "grid 5x5")
def grid_past_rope_table():
    model, text = _t2v(rope_max_seq_len=4)
    return model, lambda: forward(model, _x(1, h=10, w=10), T, text, start_frame=0, cache_tag="other")


@case(ValueError, "place the chunk at different RoPE positions", "relative and absolute")
def rollout_on_branches_of_mixed_positions():  # refused before the rollout clears or commits anything
    engines = {"main": RollingKVCacheEngine(3, positions="relative"), "vace": RollingKVCacheEngine(3)}
    model, text = _vace(engines=engines)
    return model, lambda: causal_rollout(model, _x(2), text, chunk_frames=1, timesteps=(1000,), progress=False,
                                         control_latents=_control(2))


@case(ValueError, "exceeds rope_max_seq_len", "grid 5x5")
def fresh_rollout_grid_past_rope_table():
    model, text = _t2v(rope_max_seq_len=4)
    return model, lambda: causal_rollout(model, _x(1, h=10, w=10), text, chunk_frames=1, timesteps=(1000,),
                                         progress=False)


@case(ValueError, "place the chunk at different RoPE positions", r"\[2, 3\]")
def branches_disagree_on_positions():
    model, text = _vace(frames=3, engines={"main": RollingKVCacheEngine(3, positions="relative"),
                                           "vace": RollingKVCacheEngine(3)})
    return model, lambda: forward(model, _x(1), T, text, extra={"control_hidden_states": _control(1)},
                                  start_frame=3)


@case(ValueError, "channels but the model takes in_channels", "hidden_states has 8 channels")
def wrong_channel_count():
    return _bad_forward(x=_x(1, channels=8))


@case(ValueError, "concatenates them per sample", "encoder_hidden_states_image has batch 1")
def i2v_image_batch_differs_from_text():
    model = _installed(tiny_wan(i2v=True))
    text, image = conditioning(model, batch=2)
    forward(model, _x(1, batch=2, channels=36), ZERO, text, image, start_frame=0, store_kv=True)
    return model, lambda: forward(model, _x(1, batch=2, channels=36), T, text, image[:1], start_frame=1)


# Cache continuity and staleness
@case(ValueError, "call clear_caches() or pass start_frame=", "holds 2 frames but start_frame=3")
def start_frame_gap():
    return _bad_forward(start_frame=3)


@case(ValueError, "call clear_caches() or pass start_frame=", "holds 2 frames but start_frame=1")
def start_frame_overlap():
    return _bad_forward(start_frame=1)


@case(ValueError, "was built with", "batch size 1 but this forward has 2")
def tag_of_other_batch():
    return _bad_forward(x=_x(1, batch=2), t=torch.zeros(2), text=torch.randn(2, 12, 32))


@case(ValueError, "was built with", "dtype torch.float32 but this forward has torch.float64")
def tag_of_other_dtype():
    return _bad_forward(x=_x(1, dtype=torch.float64))


@case(ValueError, "was built with", "device cpu but this forward has meta")
def tag_of_other_device():
    return _bad_forward(x=_x(1, device="meta"))


@case(ValueError, "was built with", "tokens per latent frame 4 but this forward has 16")
def tag_of_other_frame_size():
    return _bad_forward(x=_x(1, h=8, w=8))


@case(ValueError, "cross-attention K/V built from other conditioning")
def tag_of_other_conditioning():
    model, text = _t2v()
    other = text.clone()
    other[0, 3, 5] += 1e-3  # same shape, other values
    return model, lambda: forward(model, _x(1), ZERO, other, start_frame=2, store_kv=True)


@case(RuntimeError, "K/V projection weights changed since cache tag", "'pos' was filled")
def weights_changed_since_filled():
    model, text = _t2v()
    with torch.no_grad():
        model.blocks[0].attn1.to_k.weight.mul_(1.01)  # an in-place edit, as an optimizer step does
    return model, lambda: forward(model, _x(1), ZERO, text, start_frame=2, store_kv=True)


@case(RuntimeError, "store_kv=True forward refused", "fbc_leader_block_hook")
def commit_under_block_skipping_cache_hook():
    model, text = _t2v(layers=3)
    model.enable_cache(FirstBlockCacheConfig(threshold=0.0))

    def trigger():
        with model.cache_context("cond"):
            forward(model, _x(1), ZERO, text, start_frame=2, store_kv=True)

    return model, trigger


@case(RuntimeError, "so nothing was committed", "in 1 of 2 blocks")
def commit_with_a_skipped_block():
    model, text = _t2v()

    def trigger():
        model.blocks[1].forward = lambda hidden_states, *args, **kwargs: hidden_states  # the block does not run
        try:
            forward(model, _x(1), ZERO, text, start_frame=2, store_kv=True)
        finally:
            del model.blocks[1].forward

    return model, trigger


# Engines
@case(ValueError, "pass a frame count between", "between -2 and 2")
def crop_beyond_held_frames():
    model, _ = _t2v()
    return model, lambda: model.kv_cache_engines["main"].crop(3)


@case(ValueError, "were evicted from the window", r"frames 1\.\.2 were evicted")
def crop_into_evicted_frames():
    model, _ = _t2v(frames=4, engine=RollingKVCacheEngine(3, sink_frames=1))  # holds frames 0 and 3
    return model, lambda: model.kv_cache_engines["main"].crop(2)


def _engine_args(build):
    model, _ = _t2v()  # an installed model's engines, which the failed construction must leave alone
    return model, build


@case(TypeError, "must be an int (latent frames)", "window_frames must be an int")
def rolling_window_not_int():
    return _engine_args(lambda: RollingKVCacheEngine(2.5))


@case(ValueError, "window_frames must be positive")
def rolling_window_not_positive():
    return _engine_args(lambda: RollingKVCacheEngine(0))


@case(ValueError, "sink_frames must be >= 0")
def rolling_negative_sink():
    return _engine_args(lambda: RollingKVCacheEngine(3, sink_frames=-1))


@case(ValueError, "leaves no room in window_frames", "sink_frames=4 leaves no room in window_frames=4")
def rolling_sink_fills_window():
    return _engine_args(lambda: RollingKVCacheEngine(4, sink_frames=4))


@case(ValueError, "positions must be one of", "got 'rotary'")
def rolling_unknown_positions():
    return _engine_args(lambda: RollingKVCacheEngine(3, positions="rotary"))


@case(ValueError, "does not fit RollingKVCacheEngine(", "at most 3 frames")
def rolling_chunk_longer_than_window():
    model, text = _t2v(engine=RollingKVCacheEngine(3))
    return model, lambda: forward(model, _x(4), ZERO, text, start_frame=2, store_kv=True)


@case(ValueError, "does not fit RollingKVCacheEngine(", "at most 3 frames")
def fresh_rollout_chunks_longer_than_window():  # checked before the fresh rollout clears the caches
    model, text = _t2v(engine=RollingKVCacheEngine(3))
    return model, lambda: causal_rollout(model, _x(4), text, chunk_frames=4, timesteps=(1000,), progress=False)


@case(ValueError, "(the text encoder's output)", r"got \(1, 12, 7\)")
def fresh_rollout_with_a_malformed_prompt():
    model, _ = _t2v()
    return model, lambda: self_forcing_rollout(model, _x(2), torch.randn(1, 12, 7), chunk_frames=1,
                                               timesteps=(1000,))


@case(ValueError, "numbers the window's frames", "use window_frames <= 4")
def rolling_relative_window_past_rope_table():
    model, text = _t2v(rope_max_seq_len=4)
    session = {"main": RollingKVCacheEngine(6, positions="relative")}
    return model, lambda: forward(model, _x(1), ZERO, text, start_frame=0, store_kv=True, cache_engines=session)


@case(ValueError, "use crop() to go back", r"skip_to\(1\)")
def skip_backwards():
    model, _ = _t2v(engine=RollingKVCacheEngine(3))
    return model, lambda: model.kv_cache_engines["main"].skip_to(1, "pos")


@case(ValueError, "commit the whole sink", "holds 1 of its 2 sink frames")
def skip_before_the_sink_is_committed():
    model, _ = _t2v(frames=1, engine=RollingKVCacheEngine(4, sink_frames=2))
    return model, lambda: model.kv_cache_engines["main"].skip_to(5, "pos")


@case(ValueError, "max_frames must be a positive int", "got 0")
def static_max_frames_not_positive():
    return _engine_args(lambda: StaticKVCacheEngine(max_frames=0))


@case(ValueError, "StaticKVCacheEngine holds at most", r"StaticKVCacheEngine\(max_frames=4\)")
def static_chunk_past_max_frames():
    model, text = _t2v(engine=StaticKVCacheEngine(max_frames=3))
    return model, lambda: forward(model, _x(2), ZERO, text, start_frame=2, store_kv=True)


@case(ValueError, "StaticKVCacheEngine holds at most", r"StaticKVCacheEngine\(max_frames=4\)")
def fresh_rollout_past_max_frames():
    model, text = _t2v(engine=StaticKVCacheEngine(max_frames=3))
    return model, lambda: causal_rollout(model, _x(4), text, chunk_frames=2, timesteps=(1000,), progress=False)


@case(ValueError, "to a static buffer holding", "appending 8 tokens to a static buffer holding 8 of 12")
def static_append_past_max_frames():
    model, _ = _t2v(engine=StaticKVCacheEngine(max_frames=3))
    kv = torch.zeros(1, 2 * FRAME_TOKENS, 2, 12)
    return model, lambda: model.kv_cache_engines["main"].append_self_kv(0, "pos", kv, kv)


# Masks (built per forward in the mask modes, before any work)
def _mask_forward(frames=3, **ctx):
    return _bad_forward(x=_x(frames), t=T, start_frame=0, store_kv=False, mode="block_causal", **ctx)


@case(ValueError, "chunk_frames must be positive", "got 0")
def mask_chunk_frames_not_positive():
    return _mask_forward(chunk_frames=0)


@case(ValueError, "must be positive ints adding up to the", r"\[1, 1\] must be positive ints adding up to the 3")
def mask_chunk_sizes_not_adding_up():
    return _mask_forward(chunk_frames=[1, 1])


@case(ValueError, "frame_tokens must be a positive int", "got 0")
def mask_frame_tokens_not_positive():
    model, _ = _t2v()
    return model, lambda: block_causal_mask(4, 2, frame_tokens=0)


@case(ValueError, "sink_frames needs window_frames")
def mask_sink_without_window():
    return _mask_forward(chunk_frames=1, sink_frames=1)


@case(ValueError, "need window_frames > sink_frames >= 0", "window_frames=2, sink_frames=2")
def mask_sink_fills_window():
    return _mask_forward(chunk_frames=1, window_frames=2, sink_frames=2)


@case(ValueError, "does not fit the window's", "a chunk of 2 frames does not fit the window's 1 non-sink frames")
def mask_chunk_longer_than_window():
    return _mask_forward(frames=4, chunk_frames=2, window_frames=2, sink_frames=1)


# Rollout helpers
@case(ValueError, "needs boundary_ratio")
def two_expert_pipeline_without_a_boundary():
    model, text = _t2v()

    class TwoExpertPipeline:
        transformer, transformer_2 = model, _installed(tiny_wan())

    return model, lambda: causal_rollout(TwoExpertPipeline(), _x(2), text, progress=False)


@case(ValueError, "transformer_2 is the same module as transformer")
def two_expert_pipeline_with_one_module():
    model, text = _t2v()

    class TwoExpertPipeline:
        transformer, transformer_2 = model, model

    return model, lambda: causal_rollout(TwoExpertPipeline(), _x(2), text, boundary_ratio=0.9, progress=False)


@case(ValueError, "a two-expert pipeline takes cache_engines=", r"\['main'\]")
def two_expert_pipeline_with_one_engine_map():
    model, text = _t2v()

    class TwoExpertPipeline:
        transformer, transformer_2 = model, _installed(tiny_wan())

    return model, lambda: causal_rollout(TwoExpertPipeline(), _x(2), text, boundary_ratio=0.9, progress=False,
                                         cache_engines={"main": KVCacheEngine()})


@case(ValueError, "frames but noise has", "condition_latents has 2 frames but noise has 3")
def rollout_per_frame_latents_of_other_length():
    model, text = _t2v()
    return model, lambda: causal_rollout(model, _x(3), text, condition_latents=torch.randn(1, 20, 2, H, W),
                                         progress=False)


@case(ValueError, "frames but latents have", "condition_latents has 1 frames but latents have 2")
def prefill_per_frame_latents_of_other_length():
    model, text = _t2v(engine=RollingKVCacheEngine(3))  # a skip forward is allowed: checked before it
    return model, lambda: prefill(model, _x(2), text, start_frame=5, condition_latents=torch.randn(1, 20, 1, H, W))


@case(ValueError, "needs control_latents")
def vace_rollout_without_control():
    model, text = _vace()
    return model, lambda: causal_rollout(model, _x(2), text, progress=False)


@case(ValueError, "control_latents were given but")
def rollout_control_for_non_vace():
    model, text = _t2v()
    return model, lambda: causal_rollout(model, _x(2), text, control_latents=_control(2), progress=False)


@case(ValueError, "needs negative_prompt_embeds")
def rollout_guidance_without_negative_prompt():
    model, text = _t2v()
    return model, lambda: causal_rollout(model, _x(2), text, guidance_scale=5.0, progress=False)


@case(ValueError, "needs negative_prompt_embeds")
def streaming_guidance_without_negative_prompt():
    model, text = _t2v()
    return model, lambda: StreamingRollout(model, text, guidance_scale=3.0)


@case(ValueError, "needs num_inference_steps")
def scheduler_without_steps():
    model, text = _t2v()
    return model, lambda: causal_rollout(model, _x(2), text, scheduler=FlowMatchEulerDiscreteScheduler(),
                                         progress=False)


@case(ValueError, "timesteps must lie in", r"got \[1000, 0\]")
def rollout_timestep_out_of_range():
    model, text = _t2v()
    return model, lambda: causal_rollout(model, _x(2), text, timesteps=(1000, 0), progress=False)


@case(ValueError, "timesteps must lie in", r"got \[1000, 1500\]")
def self_forcing_timestep_out_of_range():
    model, text = _t2v()
    return model, lambda: self_forcing_rollout(model, _x(2), text, timesteps=(1000, 1500))


@case(ValueError, "exit_step must be an index into the", "into the 2 timesteps")
def exit_step_out_of_range():
    model, text = _t2v()
    return model, lambda: self_forcing_rollout(model, _x(2), text, exit_step=2, timesteps=(1000, 500))


@case(ValueError, "context_latents works with text-conditioned models only", "prefill()")
def context_prefix_on_vace():
    model, text = _vace()
    return model, lambda: self_forcing_rollout(model, _x(2), text, chunk_frames=1, control_latents=_control(2),
                                               context_latents=_x(1))


@case(ValueError, "must match noise", "dimension but frames")
def context_prefix_of_another_shape():
    model, text = _t2v()
    return model, lambda: self_forcing_rollout(model, _x(2), text, chunk_frames=1, context_latents=_x(1, batch=2))


@case(ValueError, "do not end on a chunk boundary", r"pass a context of one of \[2\]")
def context_prefix_inside_a_chunk():
    model, text = _t2v()
    return model, lambda: self_forcing_rollout(model, _x(3), text, chunk_frames=2, context_latents=_x(1))


@case(ValueError, "timesteps is empty", "at least one timestep")
def rollout_without_timesteps():
    model, text = _t2v()
    return model, lambda: causal_rollout(model, _x(2), text, chunk_frames=1, timesteps=(), progress=False)


@case(ValueError, "has 0 latent frames", "noise has 0")
def rollout_of_no_frames():
    model, text = _t2v()
    return model, lambda: causal_rollout(model, _x(0), text, chunk_frames=1, timesteps=(1000,), progress=False)


# Streaming
@case(ValueError, "prefill(start_frame=", r"prefill\(start_frame=1\).*continues at frame 2")
def prefill_at_another_frame():
    model, text = _t2v()
    return model, lambda: prefill(model, _x(1), text, start_frame=1)


@case(TypeError, "refills the window of a RollingKVCacheEngine")
def recache_without_rolling_engine():
    model, text = _t2v()
    return model, lambda: recache(model, [(0, _x(2))], text)


@case(ValueError, "but the window latents cover", r"holds frames \[0\.\.1\] but the window latents cover \[0\.\.0\]")
def recache_window_of_other_frames():
    model, text = _t2v(engine=RollingKVCacheEngine(3))
    return model, lambda: recache(model, [(0, _x(1))], text)


@case(ValueError, "adopt_tag() takes the tag of an engine", r"\(3, 0, 'absolute'\)")
def adopt_tag_of_another_window():
    model, text = _t2v(engine=RollingKVCacheEngine(3))
    other = RollingKVCacheEngine(4)
    return model, lambda: model.kv_cache_engines["main"].adopt_tag(other, "pos")


@case(NotImplementedError, "re-caches text-conditioned streams only")
def streaming_rollout_recache_on_vace():
    model, text = _vace(frames=0, engines={"main": RollingKVCacheEngine(3), "vace": RollingKVCacheEngine(3)})
    stream = StreamingRollout(model, text, chunk_frames=1, timesteps=(1000,))
    stream.generate(_x(1), control_latents=_control(1))
    return model, lambda: stream.switch_prompt(text)


@case(RuntimeError, "was written by another caller", "Start a new stream")
def streaming_after_a_commit_behind_its_back():
    model = _installed(tiny_wan(), {"main": RollingKVCacheEngine(3)})
    text, _ = conditioning(model, batch=1)
    stream = StreamingRollout(model, text, chunk_frames=1, timesteps=(1000,))
    stream.generate(_x(1))
    forward(model, _x(1), ZERO, text, start_frame=stream.next_frame, store_kv=True)  # not through the rollout
    return model, lambda: stream.generate(_x(1))


@case(ValueError, "the engine holds no such tag", r"reset_conditioning\('neg'\)")
def engine_reset_conditioning_of_an_empty_tag():
    model, text = _t2v()
    return model, lambda: model.kv_cache_engines["main"].reset_conditioning("neg")


@case(ValueError, "is not filled on branches", r"\['main', 'vace'\]")
def reset_conditioning_of_an_empty_tag():
    from diffusers_causal_kv import reset_conditioning

    model, text = _vace()
    return model, lambda: reset_conditioning(model, "neg")


@case(ValueError, "prompt switch mode must be")
def streaming_switch_prompt_unknown_mode():
    model = _installed(tiny_wan(), {"main": RollingKVCacheEngine(3)})
    text, _ = conditioning(model, batch=1)
    stream = StreamingRollout(model, text, chunk_frames=1, timesteps=(1000,))
    stream.generate(_x(1))
    return model, lambda: stream.switch_prompt(text, mode="replace")


# Commit timesteps, the causal config and CausalWanPipeline
@case(ValueError, "context_noise_mode must be 'label' or 'renoise'")
def unknown_context_noise_mode():
    model, text = _t2v()
    return model, lambda: causal_rollout(model, _x(2), text, context_noise=100.0, context_noise_mode="noisy",
                                         progress=False)


@case(ValueError, "context_noise is a timestep in [0, 1000]")
def context_noise_out_of_range():
    model, text = _t2v()
    return model, lambda: prefill(model, _x(1), text, context_noise=1500.0)


def _config_trigger(text):
    """Writes ``text`` as ``causal_config.json`` into a new folder and returns a loader of it."""
    import tempfile

    from diffusers_causal_kv import CausalConfig

    directory = pathlib.Path(tempfile.mkdtemp())
    (directory / "causal_config.json").write_text(text)
    return lambda: CausalConfig.load(directory)


@case(ValueError, "invalid causal config", r"sink_frames \(4\) must be below window_frames \(4\)")
def causal_config_with_a_sink_filling_the_window():
    return _t2v()[0], _config_trigger('{"window_frames": 4, "sink_frames": 4}')


@case(ValueError, "invalid causal config", r"shift must be a finite number > 0, got 'abc'")
def causal_config_with_text_for_a_number():
    from diffusers_causal_kv import CausalConfig

    return _t2v()[0], lambda: CausalConfig(shift="abc")


@case(ValueError, "invalid causal config", r"causal_config\.json: shift must be a finite number > 0, got nan")
def causal_config_with_nan():
    return _t2v()[0], _config_trigger('{"shift": NaN}')


@case(ValueError, "invalid causal config", r"timesteps must be a non-empty list of finite numbers .*, got 1000\.")
def causal_config_with_a_number_for_a_list():
    return _t2v()[0], _config_trigger('{"timesteps": 1000}')


@case(ValueError, "has unknown keys", r"\['chunk_size'\]")
def causal_config_with_an_unknown_key():
    return _t2v()[0], _config_trigger('{"chunk_size": 3}')


@case(ValueError, "is not valid JSON")
def causal_config_that_is_not_json():
    return _t2v()[0], _config_trigger("chunk_frames: 3")


@case(ValueError, "must hold a JSON object")
def causal_config_that_is_a_list():
    return _t2v()[0], _config_trigger("[3]")


def _called_pipeline(transformer=None, run=True, **first):
    """A CausalWanPipeline on tiny components after one call with ``first`` added to its arguments (its cache holds
    2 frames; none with ``run=False``, just an empty engine map), and that call's arguments."""
    from diffusers_causal_kv import CausalConfig, CausalWanPipeline
    from diffusers_causal_kv.testing import tiny_pipeline_components

    pipe = CausalWanPipeline(**tiny_pipeline_components(transformer), causal_config=CausalConfig(chunk_frames=1))
    args = {**dict(prompt="a ball", height=16, width=16, num_frames=5, timesteps=[1000], max_sequence_length=8,
                   output_type="latent"), **first}
    if run:
        pipe(**args)
    else:
        _installed(pipe.transformer, {"main": KVCacheEngine()})
    return pipe, args


def _pipeline(transformer=None, first=None, **call):
    """The called pipeline's transformer, and the call again with ``call`` changed."""
    pipe, args = _called_pipeline(transformer, **(first or {}))
    return pipe.transformer, lambda: pipe(**{**args, **call})


@case(ValueError, "needs both transformer_2 and boundary_ratio")
def pipeline_with_a_boundary_ratio():
    pipe, args = _called_pipeline()
    pipe.register_to_config(boundary_ratio=0.9)
    return pipe.transformer, lambda: pipe(**args)


@case(ValueError, "height and width must be multiples of 16")
def pipeline_height_not_a_multiple_of_16():
    return _pipeline(height=20)


@case(ValueError, "output_type must be 'np', 'pil', 'pt' or 'latent'")
def pipeline_unknown_output_type():
    return _pipeline(output_type="mp4")


@case(ValueError, "are not among the callback tensors")
def pipeline_unknown_callback_tensor():
    return _pipeline(callback_on_step_end=lambda *a: {}, callback_on_step_end_tensor_inputs=["noise_pred"])


@case(ValueError, "reference_images are not supported by the causal VACE path")
def pipeline_reference_images():
    return _pipeline(reference_images=[object()])


@case(ValueError, "generator is a list of", "a list of 2 generators but the batch has 1")
def pipeline_generator_list_of_another_length():
    return _pipeline(generator=[torch.Generator(), torch.Generator()])


@case(TypeError, "generator must be a torch.Generator or a", "got int")
def pipeline_generator_of_another_type():
    return _pipeline(generator=3)


@case(ValueError, "but the pipeline's causal config describes", "transformer.kv_cache_engines = None")
def pipeline_own_engines_unlike_the_config():
    from diffusers_causal_kv import CausalConfig

    pipe, args = _called_pipeline()  # its own engines, holding the call's frames
    pipe.transformer.kv_cache_engines = {"main": KVCacheEngine()}
    pipe(**args)
    pipe.causal_config = CausalConfig(chunk_frames=1, window_frames=3, sink_frames=1)
    return pipe.transformer, lambda: pipe(**args)


@case(ValueError, "with_prompts: tags", r"\['neg'\]")
def planner_with_prompts_of_another_tag():
    model, text = _t2v()
    planner = RolloutPlanner(model, text)
    return model, lambda: planner.with_prompts(neg=text)


@case(ValueError, "needs a prompt or prompt_embeds")
def pipeline_without_a_prompt():
    return _pipeline(prompt=None)


@case(TypeError, "must be a string or a non-empty list of strings", "got int 123")
def pipeline_prompt_that_is_not_text():
    return _pipeline(prompt=123)


@case(TypeError, "from_pipe takes a loaded pipeline", "CausalWanPipeline.from_pretrained")
def pipeline_from_pipe_of_a_hub_id():
    pipe, _ = _called_pipeline()
    return pipe.transformer, lambda: type(pipe).from_pipe("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")


@case(TypeError, "from_pipe takes a loaded pipeline", "pass a model as a component")
def pipeline_from_pipe_of_a_model():
    pipe, _ = _called_pipeline()
    return pipe.transformer, lambda: type(pipe).from_pipe(pipe.transformer)


@case(TypeError, "from_pipe takes a loaded pipeline", "got dict")
def pipeline_from_pipe_of_another_object():
    pipe, _ = _called_pipeline()
    return pipe.transformer, lambda: type(pipe).from_pipe({"transformer": pipe.transformer})


@case(ValueError, "but this call needs")
def pipeline_latents_of_another_shape():
    return _pipeline(latents=torch.randn(1, 16, 3, 2, 2))


@case(ValueError, "(it takes condition latents): pass image")
def pipeline_i2v_without_an_image():
    i2v = dict(image=torch.zeros(1, 3, 16, 16), image_embeds=torch.randn(1, 4, 8), max_sequence_length=512)
    return _pipeline(tiny_wan(i2v=True), first=i2v, image=None)


@case(ValueError, "image was given but the transformer is not an I2V model")
def pipeline_image_for_a_t2v_model():
    return _pipeline(image=torch.zeros(1, 3, 16, 16))


def _stream_call(**call):
    """A called pipeline's transformer, and ``pipe.stream(...)`` with ``call`` (streams have engines of their own)."""
    pipe, args = _called_pipeline()
    args = {k: v for k, v in args.items() if k not in ("output_type", "num_frames")}
    return pipe.transformer, lambda: pipe.stream(**args, output_type="latent", **call), pipe, args


@case(ValueError, "strength must lie in")
def stream_strength_zero():
    return _stream_call(video=[], strength=0.0)[:2]


@case(ValueError, "keeps none of the timesteps", r"at least 1\.0")
def stream_strength_below_every_timestep():
    return _stream_call(video=[], strength=0.5)[:2]


@case(ValueError, "streams take a text-to-video transformer")
def stream_video_to_video_on_i2v():
    i2v = dict(image=torch.zeros(1, 3, 16, 16), image_embeds=torch.randn(1, 4, 8), max_sequence_length=512)
    pipe, args = _called_pipeline(tiny_wan(i2v=True), **i2v)
    args = {k: v for k, v in args.items() if k not in ("output_type", "num_frames")}
    return pipe.transformer, lambda: pipe.stream(**args, video=[])


@case(ValueError, "resume= takes a closed stream")
def stream_resume_of_a_running_stream():
    model, start, pipe, args = _stream_call()
    return model, lambda: pipe.stream(**args, resume=start())


@case(TypeError, "step_streams takes streams made by", "got list_iterator")
def step_streams_of_an_iterator():
    from diffusers_causal_kv.serve import step_streams

    model, start, _, _ = _stream_call()
    return model, lambda: step_streams([start(), iter([])])


@case(ValueError, "got the same stream twice")
def step_streams_with_one_stream_twice():
    from diffusers_causal_kv.serve import step_streams

    model, start, _, _ = _stream_call()
    stream = start()
    return model, lambda: step_streams([stream, stream])


@case(ValueError, "give each stream engines of its own", "cache tag 'pos'")
def step_streams_sharing_engines():
    from diffusers_causal_kv.serve import step_streams

    model, _, pipe, args = _stream_call()
    engines = {"main": KVCacheEngine()}
    return model, lambda: step_streams([pipe.stream(**args, output_type="latent", cache_engines=engines)
                                        for _ in range(2)])


@case(ValueError, "continues in groups of", "got 5")
def stream_resume_with_a_partial_group():
    model, start, pipe, args = _stream_call(num_frames=5)
    stream = start()
    next(stream)
    stream.close()
    return model, lambda: pipe.stream(**args, num_frames=5, resume=stream, output_type="latent")


def _resumable(**call):
    model, start, pipe, args = _stream_call(num_frames=13, **call)
    stream = start()
    next(stream)
    stream.close()
    return model, pipe, args, stream


@case(ValueError, "decodes as the closed one did")
def stream_resume_with_another_output_kind():
    model, pipe, args, stream = _resumable()
    return model, lambda: pipe.stream(**args, num_frames=4, resume=stream, output_type="np")


@case(ValueError, "keeps its session's engines", "window_frames")
def stream_resume_with_other_engines():
    model, pipe, args, stream = _resumable()
    return model, lambda: pipe.stream(**args, num_frames=4, resume=stream, output_type="latent", window_frames=3)


@case(ValueError, "keeps its session's sampling", "timesteps")
def stream_resume_with_other_timesteps():
    model, pipe, args, stream = _resumable()
    return model, lambda: pipe.stream(**{**args, "timesteps": [1000, 500]}, num_frames=4, resume=stream,
                                      output_type="latent")


@case(ValueError, "keeps its session's guidance")
def stream_resume_with_other_guidance():
    model, pipe, args, stream = _resumable()
    return model, lambda: pipe.stream(**args, num_frames=4, resume=stream, output_type="latent", guidance_scale=3.0)


@case(ValueError, "first makes again the chunk", "num_frames=4")
def stream_resume_with_fewer_frames_than_a_failed_chunk():
    model, start, pipe, args = _stream_call(num_frames=13, chunk_frames=2)
    stream = start()
    next(stream)
    def busy(*_):
        raise RuntimeError("a transient error")

    fail = model.register_forward_pre_hook(busy)
    with pytest.raises(RuntimeError, match="a transient error"):
        next(stream)  # the chunk of 2 latent frames stays to be made again
    fail.remove()
    stream.close()
    return model, lambda: pipe.stream(**args, num_frames=4, resume=stream, output_type="latent")


@case(ValueError, "continues with its own noise")
def stream_resume_with_another_generator():
    model, start, pipe, args = _stream_call(num_frames=5)
    stream = start()
    next(stream)
    stream.close()
    return model, lambda: pipe.stream(**args, num_frames=4, resume=stream, generator=torch.Generator(),
                                      output_type="latent")


@case(ValueError, "are not chunks of this stream", r"\[7\]")
def stream_schedule_past_its_end():
    return _stream_call(num_frames=5, prompt_schedule={7: "a cube"})[:2]


@case(ValueError, "prompt switch mode must be")
def stream_switch_unknown_mode():
    model, start, _, _ = _stream_call()
    stream = start()
    return model, lambda: stream.switch_prompt("a cube", mode="swap")


@case(ValueError, "takes a prompt or prompt_embeds (one of the two)")
def stream_switch_without_a_prompt():
    model, start, _, _ = _stream_call()
    stream = start()
    return model, lambda: stream.switch_prompt()


@case(ValueError, "frames, but the stream's next chunk needs", "ran out after 0 frames")
def stream_input_video_runs_out():
    model, start, _, _ = _stream_call(video=iter([]))
    stream = start()
    return model, lambda: next(stream)


@case(ValueError, "in the middle of a chunk", cached=False)
def pipeline_callback_changing_the_prompt():
    # The callback runs after the rollout cleared the cache (nothing can tell earlier what it returns): the error
    # comes before the first chunk's commit, so the cache is left empty, as the snapshot of a fresh map says.
    pipe, args = _called_pipeline(run=False)
    return pipe.transformer, lambda: pipe(**args, callback_on_step_end_tensor_inputs=["prompt_embeds"],
                                          callback_on_step_end=lambda p, i, t, kw: {
                                              "prompt_embeds": kw["prompt_embeds"] + 1})


# Modular Pipelines
def _modular(model, guider=None, **components):
    """The causal Wan block set on ``model``, without the text encoder and VAE decoder steps (embeddings given)."""
    from diffusers.guiders import ClassifierFreeGuidance

    from diffusers_causal_kv.modular import causal_wan_blocks

    blocks = causal_wan_blocks()
    for name in ("text_encoder", "decode"):
        blocks.sub_blocks.pop(name)
    pipe = blocks.init_pipeline()
    pipe.update_components(transformer=model, guider=guider or ClassifierFreeGuidance(guidance_scale=1.0), **components)
    return pipe


@case(NotImplementedError, "the causal denoise blocks do not cover", "has the denoise step CausalWanCoreDenoiseStep")
def modular_block_set_of_another_denoise_step():
    from diffusers_causal_kv.modular import causal_wan_blocks

    model, _ = _t2v()
    return model, lambda: causal_wan_blocks(causal_wan_blocks())


@case(NotImplementedError, "the causal denoise blocks do not cover", "WanVACETransformer3DModel")
def modular_vace_transformer():
    model, text = _vace()
    pipe = _modular(model)
    return model, lambda: pipe(prompt_embeds=text, latents=_x(2), chunk_frames=1)


@case(ValueError, "reference_images are not supported by the causal VACE path", "prefilled before frame 0")
def modular_vace_reference_images():
    import PIL.Image
    from diffusers.guiders import ClassifierFreeGuidance

    from diffusers_causal_kv.modular import causal_wan22_vace_blocks
    from diffusers_causal_kv.testing import tiny_vae

    model, text = _vace()
    blocks = causal_wan22_vace_blocks()
    for name in ("text_encoder", "decode"):
        blocks.sub_blocks.pop(name)
    pipe = blocks.init_pipeline()
    pipe.update_components(transformer=model, vae=tiny_vae(seed=0), guider=ClassifierFreeGuidance(guidance_scale=1.0))
    reference = PIL.Image.new("RGB", (32, 32))
    return model, lambda: pipe(prompt_embeds=text, reference_images=reference, height=32, width=32, num_frames=5,
                               output="latents")


@case(ValueError, "needs a transformer component")
def modular_without_transformer():
    model, text = _t2v()
    pipe = _modular(None)
    return model, lambda: pipe(prompt_embeds=text, latents=_x(2), chunk_frames=1)


@case(TypeError, "install CausalWanAttnProcessor only over the stock WanAttnProcessor", "run MaskedStockProcessor")
def modular_transformer_with_other_processors():
    from helpers import MaskedStockProcessor

    model, text = _t2v()
    model.set_attn_processor(MaskedStockProcessor())
    pipe = _modular(model)
    return model, lambda: pipe(prompt_embeds=text, latents=_x(2), chunk_frames=1)


@case(ValueError, "but negative_prompt_embeds is None", r"ClassifierFreeGuidance\) runs classifier-free guidance")
def modular_guidance_without_negative_prompt():
    from diffusers.guiders import ClassifierFreeGuidance

    model, text = _t2v()
    pipe = _modular(model, ClassifierFreeGuidance(guidance_scale=5.0))
    return model, lambda: pipe(prompt_embeds=text, latents=_x(2), chunk_frames=1)


@case(NotImplementedError, "caches only a guider's plain conditional and", "SkipLayerGuidance changes the model")
def modular_guider_perturbing_the_model():
    from diffusers.guiders import SkipLayerGuidance

    model, text = _t2v()
    pipe = _modular(model, SkipLayerGuidance(skip_layer_guidance_layers=[0]))
    return model, lambda: pipe(prompt_embeds=text, negative_prompt_embeds=text, latents=_x(2), chunk_frames=1)


@case(ValueError, "pass either timesteps (few-step sampling) or num_inference_steps")
def modular_timesteps_and_scheduler_steps():
    model, text = _t2v()
    pipe = _modular(model, scheduler=FlowMatchEulerDiscreteScheduler())
    return model, lambda: pipe(prompt_embeds=text, latents=_x(2), timesteps=[1000], num_inference_steps=2)


@case(ValueError, "but it has no scheduler component")
def modular_scheduler_steps_without_scheduler():
    model, text = _t2v()
    pipe = _modular(model)
    return model, lambda: pipe(prompt_embeds=text, latents=_x(2), num_inference_steps=2)


# Streaming VAE
def _no_cache():
    """A tiny installed transformer with nothing cached: the streaming VAE never touches a KV cache."""
    return _installed(tiny_wan(), {"main": KVCacheEngine()})


@case(TypeError, "wraps a diffusers AutoencoderKLWan", "got Conv3d", cached=False)
def streaming_vae_of_another_model():
    from diffusers_causal_kv.streaming_vae import StreamingVAEDecoder

    return _no_cache(), lambda: StreamingVAEDecoder(torch.nn.Conv3d(16, 3, 1))


@case(RuntimeError, "internals that this diffusers release lacks", r"lacks: vae\.decoder;.*<0\.43", cached=False)
def streaming_vae_without_a_relied_on_internal():
    from diffusers_causal_kv.streaming_vae import StreamingVAEDecoder
    from diffusers_causal_kv.testing import tiny_vae

    vae = tiny_vae(seed=0)
    del vae.decoder  # as if a diffusers release had renamed it
    return _no_cache(), lambda: StreamingVAEDecoder(vae)


@case(ValueError, "takes the pipeline's normalised latents", r"\[batch, 16, frames.*got \(1, 48, 1, 2, 2\)",
      cached=False)
def streaming_vae_decode_of_other_channels():
    from diffusers_causal_kv.streaming_vae import StreamingVAEDecoder
    from diffusers_causal_kv.testing import tiny_vae

    decoder = StreamingVAEDecoder(tiny_vae(seed=0))
    return _no_cache(), lambda: decoder.decode(torch.zeros(1, 48, 1, 2, 2))


@case(ValueError, "takes video frames [batch,", r"\[batch, 3, frames.*got \(1, 16, 4, 16, 16\)", cached=False)
def streaming_vae_encode_of_latents():
    from diffusers_causal_kv.streaming_vae import StreamingVAEEncoder
    from diffusers_causal_kv.testing import tiny_vae

    encoder = StreamingVAEEncoder(tiny_vae(seed=0))
    return _no_cache(), lambda: encoder.encode(torch.zeros(1, 16, 4, 16, 16))


@case(ValueError, "sample_mode must be", "got 'mean'", cached=False)
def streaming_vae_encode_of_unknown_sample_mode():
    from diffusers_causal_kv.streaming_vae import StreamingVAEEncoder
    from diffusers_causal_kv.testing import tiny_vae

    encoder = StreamingVAEEncoder(tiny_vae(seed=0))
    return _no_cache(), lambda: encoder.encode(torch.zeros(1, 3, 1, 16, 16), sample_mode="mean")


@case(ValueError, "but this stream started with", r"batch is 1 but this stream started with 2.*reset\(\)",
      cached=False)
def streaming_vae_decode_of_another_batch():
    from diffusers_causal_kv.streaming_vae import StreamingVAEDecoder
    from diffusers_causal_kv.testing import tiny_vae

    decoder = StreamingVAEDecoder(tiny_vae(seed=0))
    decoder.decode(torch.zeros(2, 16, 1, 2, 2))
    return _no_cache(), lambda: decoder.decode(torch.zeros(1, 16, 1, 2, 2))


# Checkpoint conversion
def _conversion(write_source, **kwargs):
    """A tiny installed transformer with nothing cached (conversion never touches a KV cache), and a trigger that
    converts what ``write_source(folder)`` writes into a fresh temporary folder (``out``: one of its own)."""
    import tempfile

    from diffusers_causal_kv.convert import convert_checkpoint

    folder = pathlib.Path(tempfile.mkdtemp())
    src = write_source(folder)
    kwargs = {"num_attention_heads": 2, "out": pathlib.Path(tempfile.mkdtemp()) / "out", **kwargs}
    return _installed(tiny_wan(), {"main": KVCacheEngine()}), lambda: convert_checkpoint(src, **kwargs)


def _self_forcing_file(folder, name="self_forcing_dmd.pt", **extra):
    from convert_fixtures import write_wrapper

    return write_wrapper(folder / name, tiny_wan(), extra=extra)


def _longlive_lora(lora):
    """A LongLive ``lora.pt`` holding ``lora`` as its generator's LoRA, in a temporary folder of its own."""
    import tempfile

    from convert_fixtures import save_pt

    return save_pt(pathlib.Path(tempfile.mkdtemp()) / "lora.pt", {"generator_lora": lora, "step": 1})


@case(FileNotFoundError, "no checkpoint at", "missing.pt", cached=False)
def convert_missing_file():
    return _conversion(lambda folder: folder / "missing.pt")


@case(ValueError, "could not be read as a checkpoint", "self_forcing_dmd.pt.*download it again", cached=False)
def convert_truncated_file():
    def write(folder):
        src = pathlib.Path(_self_forcing_file(folder))
        src.write_bytes(src.read_bytes()[:2000])
        return src

    return _conversion(write)


@case(ValueError, "cannot be loaded with weights_only=True", "self_forcing_dmd.pt", cached=False)
def convert_pickle_with_objects():
    import argparse

    return _conversion(lambda folder: _self_forcing_file(folder, config=argparse.Namespace(lr=1e-5)))


@case(ValueError, "holds no transformer weights", r"found \[\]", cached=False)
def convert_empty_folder():
    return _conversion(lambda folder: folder)


@case(ValueError, "not a Wan checkpoint layout the converter knows", r"vae\.pt.*encoder\.conv1\.weight", cached=False)
def convert_unknown_layout():
    from convert_fixtures import save_pt

    return _conversion(lambda folder: save_pt(folder / "vae.pt", {"encoder.conv1.weight": torch.zeros(1)}))


@case(ValueError, "entry to convert", r"no 'generator_ema' entry.*\['critic', 'generator'\].*--no-ema", cached=False)
def convert_ema_that_is_not_there():
    return _conversion(_self_forcing_file, ema=True)


@case(ValueError, "but format=", "expects a wrapper .pt", cached=False)
def convert_with_the_wrong_format():
    from convert_fixtures import original_state_dict
    from safetensors.torch import save_file

    def write(folder):
        save_file(original_state_dict(tiny_wan()), folder / "krea-realtime-video-14b.safetensors")
        return folder / "krea-realtime-video-14b.safetensors"

    return _conversion(write, format="longlive")


@case(ValueError, "cannot tell which causal checkpoint", "model.pt", cached=False)
def convert_anonymous_wrapper():
    return _conversion(lambda folder: _self_forcing_file(folder, name="model.pt"))


@case(NotImplementedError, "checkpoints cannot be converted", r"Reward Forcing.*format='reward_forcing'.*EMA sink",
      cached=False)
def convert_reward_forcing():
    return _conversion(_self_forcing_file, format="reward_forcing")


@case(NotImplementedError, "checkpoints cannot be converted",
      r"StreamDiffusionV2.*folder's name 'wan_causal_dmd_v2v'.*format='causvid'", cached=False)
def convert_streamdiffusionv2_by_its_folder():
    return _conversion(lambda folder: _self_forcing_file(folder / "wan_causal_dmd_v2v", name="model.pt"))


@case(NotImplementedError, "checkpoints cannot be converted", r"MemFlow.*memory bank", cached=False)
def convert_memflow():
    return _conversion(_self_forcing_file, format="memflow")


@case(ValueError, "format must be one of", "got 'selfforcing'", cached=False)
def convert_unknown_format():
    return _conversion(_self_forcing_file, format="selfforcing")


@case(ValueError, "lora_mode must be one of", "got 'fuse'", cached=False)
def convert_unknown_lora_mode():
    return _conversion(_self_forcing_file, lora_mode="fuse")


@case(ValueError, "dtype must be one of", "got 'float8'", cached=False)
def convert_unknown_dtype():
    return _conversion(_self_forcing_file, dtype="float8")


@case(ValueError, "keys do not map onto WanTransformer3DModel", r"missing .*blocks\.1\.ffn\.net\.2\.bias", cached=False)
def convert_incomplete_state_dict():
    from convert_fixtures import original_state_dict, save_pt

    def write(folder):
        state = original_state_dict(tiny_wan(), prefix="model.")
        del state["model.blocks.1.ffn.2.bias"]
        return save_pt(folder / "self_forcing_dmd.pt", {"generator": state})

    return _conversion(write)


@case(ValueError, "cannot split dim", "dim 24 into num_attention_heads=5", cached=False)
def convert_heads_not_dividing_the_width():
    return _conversion(_self_forcing_file, num_attention_heads=5)


@case(ValueError, "LoRA conversion does not map", r"lora\.pt", cached=False)
def convert_lora_of_unknown_keys():
    lora = {"base_model.model.vae.conv.lora_A.weight": torch.zeros(4, 8)}
    return _conversion(_self_forcing_file, lora=_longlive_lora(lora))


@case(ValueError, "do not fit the model", r"blocks\.0\.attn1\.to_q \(A \(4, 7\)", cached=False)
def convert_lora_of_another_model():
    lora = {"base_model.model.blocks.0.self_attn.q.lora_A.weight": torch.zeros(4, 7),
            "base_model.model.blocks.0.self_attn.q.lora_B.weight": torch.zeros(24, 4)}
    return _conversion(_self_forcing_file, lora=_longlive_lora(lora))


def _experts(folder, low_in_channels=36):
    """A diffusers folder of two tiny Wan2.2 I2V-A14B experts (36 input channels, no image embedder)."""
    from convert_fixtures import write_diffusers_experts

    return write_diffusers_experts(folder / "experts", tiny_wan(in_channels=36), tiny_wan(in_channels=low_in_channels))


@case(ValueError, "a Wan2.2 A14B checkpoint holds two experts", "low_noise_model", cached=False)
def convert_a_missing_expert():
    from convert_fixtures import original_state_dict, write_safetensors_shards

    def write(folder):
        write_safetensors_shards(folder / "experts" / "high_noise_model", original_state_dict(tiny_wan(in_channels=36)))
        return folder / "experts"

    return _conversion(write)


@case(ValueError, "holds no Wan2.2 A14B experts", r"base .*self_forcing_dmd\.pt", cached=False)
def convert_experts_onto_a_one_model_base():
    import tempfile

    base = _self_forcing_file(pathlib.Path(tempfile.mkdtemp()))
    return _conversion(_experts, base=base)


@case(ValueError, "experts do not share one config", "in_channels: 36 vs 16", cached=False)
def convert_experts_of_two_models():
    return _conversion(lambda folder: _experts(folder, low_in_channels=16))


@case(ValueError, "applies one LoRA to one model", "--base", cached=False)
def convert_experts_with_one_lora():
    return _conversion(_experts, lora=_longlive_lora({}))


@case(ValueError, "holds only LoRA weights", r"lora\.safetensors.*--base", cached=False)
def convert_a_lora_without_its_base():
    from safetensors.torch import save_file

    def write(folder):
        save_file({"blocks.0.self_attn.q.lora_A.weight": torch.zeros(4, 24),
                   "blocks.0.self_attn.q.lora_B.weight": torch.zeros(24, 4)}, folder / "lora.safetensors")
        return folder / "lora.safetensors"

    return _conversion(write)


@case(ValueError, "merges a LoRA-only checkpoint", "holds model weights", cached=False)
def convert_full_weights_onto_a_base():
    import tempfile

    base = _self_forcing_file(pathlib.Path(tempfile.mkdtemp()))
    return _conversion(_self_forcing_file, base=base)


@case(ValueError, "the converter cannot dequantize", r"q\.weight \(torch\.uint8\)", cached=False)
def convert_packed_quantized_weights():
    from convert_fixtures import original_state_dict
    from safetensors.torch import save_file

    def write(folder):
        state = original_state_dict(tiny_wan())
        state["blocks.0.self_attn.q.weight"] = torch.zeros(24, 24, dtype=torch.uint8)
        save_file(state, folder / "model_4o6.safetensors")
        return folder / "model_4o6.safetensors"

    return _conversion(write)


@case(ValueError, "lora_alpha must be a finite number", "got nan", cached=False)
def convert_with_a_nan_lora_alpha():
    return _conversion(_self_forcing_file, lora_alpha=float("nan"))


@case(ValueError, "max_shard_size must be", "got '10 gigs'", cached=False)
def convert_with_an_unknown_shard_size():
    return _conversion(_self_forcing_file, max_shard_size="10 gigs")


@case(ValueError, "invalid causal config", r"--set\): guidance_scale must be a finite number, got 'high'", cached=False)
def convert_with_text_for_a_setting():
    return _conversion(_self_forcing_file, causal_config={"guidance_scale": "high"})


@case(ValueError, "already exists and is not empty", "--overwrite", cached=False)
def convert_into_a_filled_folder():
    import tempfile

    out = pathlib.Path(tempfile.mkdtemp())
    (out / "notes.txt").write_text("an earlier conversion, or anything else")
    return _conversion(_self_forcing_file, out=out)


@case(ValueError, "the converter never writes where it reads", r"OUT .* holds the source .*self_forcing_dmd\.pt",
      cached=False)
def convert_into_the_source_folder():
    import tempfile

    from diffusers_causal_kv.convert import convert_checkpoint

    folder = pathlib.Path(tempfile.mkdtemp())
    src = _self_forcing_file(folder)
    return _installed(tiny_wan(), {"main": KVCacheEngine()}), lambda: convert_checkpoint(src, folder,
                                                                                        num_attention_heads=2)


@case(ValueError, "names a shard outside its folder", r"\.\./elsewhere/", cached=False)
def convert_an_index_naming_shards_elsewhere():
    import json

    from convert_fixtures import original_state_dict, write_safetensors_shards

    def write(folder):
        index = pathlib.Path(write_safetensors_shards(folder / "elsewhere", original_state_dict(tiny_wan())))
        shards = json.loads(index.read_text())
        shards["weight_map"] = {key: f"../elsewhere/{name}" for key, name in shards["weight_map"].items()}
        (folder / "model").mkdir()
        (folder / "model" / index.name).write_text(json.dumps(shards))
        return folder / "model" / index.name

    return _conversion(write)


@case(RuntimeError, "failed its check after writing", "does not load back as planned", cached=False)
def convert_and_read_back_other_files():
    """A disk returning other tensors than were written is simulated: the written files read back as holding none."""
    model, convert = _conversion(_self_forcing_file)

    def trigger():
        with mock.patch("diffusers_causal_kv.convert.output._stored_tensors", return_value={}):
            convert()
    return model, trigger


# Quantized KV cache
@case(ValueError, "kv_dtype must be None", "got torch.bfloat16")
def engine_of_another_kv_dtype():
    return _engine_args(lambda: StaticKVCacheEngine(max_frames=4, kv_dtype=torch.bfloat16))


# Memory plan
def _plan(**kwargs):
    from diffusers_causal_kv.memory_plan import memory_plan

    return _engine_args(lambda: memory_plan(**{"model": "wan2.1-1.3b", **kwargs}))


@case(ValueError, "is neither a preset", "wan2.1-1.3b")
def plan_of_an_unknown_model():
    return _plan(model="wan9")


@case(ValueError, "is not planned", "gguf-q4_k")
def plan_of_nvfp4_weights():
    return _plan(weights="nvfp4")


@case(ValueError, "is not a planned", "cache_dtype='int4'")
def plan_of_an_unknown_cache_dtype():
    return _plan(cache_dtype="int4")


@case(ValueError, "must be multiples of 16 (8x VAE", "480x830")
def plan_of_an_odd_size():
    return _plan(width=830)


@case(ValueError, "does not fit next to the sink in window_frames", "chunk_frames=3")
def plan_of_a_chunk_past_the_window():
    return _plan(window_frames=4, sink_frames=2)


@case(ValueError, "does not divide the", "context_parallel=7")
def plan_of_an_uneven_context_parallel_split():
    return _plan(context_parallel=7)


# The stream server: a client's request is refused whole (the session table is checked unchanged in
# tests/test_serve.py; here, an installed model's cache)
def _request(text):
    from diffusers_causal_kv.serve.protocol import Limits, RequestParser

    return _engine_args(lambda: RequestParser(Limits(max_prompt_chars=20, max_frames=33)).parse(text))


def _request_case(fragment, detail, text):
    from diffusers_causal_kv.serve.protocol import RequestError

    def build():
        return _request(text)

    build.__name__ = "request_" + re.sub(r"\W+", "_", detail).strip("_").lower()
    case(RequestError, fragment, re.escape(detail))(build)


for _fragment, _detail, _text in [
    ("a message holds at most", "4096 bytes", '{"type": "stop", "pad": "' + "x" * 5000 + '"}'),
    ("a message must be one JSON object", "Expecting value", "not json"),
    ("type must be one of", "got 'play'", '{"type": "play"}'),
    ("message takes the fields", "drop ['fps']", '{"type": "start", "prompt": "x", "fps": 30}'),
    ("is required: a non-empty string", "prompt is required", '{"type": "start"}'),
    ("must be a non-empty string, got", "got '   '", '{"type": "start", "prompt": "   "}'),
    ("characters, got", "at most 20 characters, got 21", '{"type": "start", "prompt": "' + "x" * 21 + '"}'),
    ("must be an integer from", "height must be an integer from 16 to 480, got 4096",
     '{"type": "start", "prompt": "x", "height": 4096}'),
    ("must be a multiple of", "width must be a multiple of 16, got 40",
     '{"type": "start", "prompt": "x", "width": 40}'),
    ("k + 1 video frames", "got 6", '{"type": "start", "prompt": "x", "num_frames": 6}'),
    ("guidance_scale must be a number from 1 to", "got nan",
     '{"type": "start", "prompt": "x", "guidance_scale": NaN}'),
    ("must be one of", "prompt_switch must be one of", '{"type": "start", "prompt": "x", "prompt_switch": "fade"}'),
]:
    _request_case(_fragment, _detail, _text)


@case(ValueError, "and at most the limit", "the default height 40 must be a multiple of 16", cached=False)
def server_with_a_default_size_past_its_limits():
    from diffusers_causal_kv.serve.server import ServerOptions, create_server

    pipe, _ = _called_pipeline(run=False)
    return pipe.transformer, lambda: create_server(pipe, ServerOptions(height=40, width=32))


@pytest.mark.parametrize("build, error, fragment, detail, cached", CASES)
def test_error_leaves_the_cache_unchanged(build, error, fragment, detail, cached):
    model, trigger = build()
    before = cache_snapshot(model)
    held = [frames for meta, _, _ in before.values() for frames, _ in meta.values()]
    assert any(held) == cached, "the state must hold committed frames where a cache is involved"
    with pytest.raises(error, match=re.escape(fragment)) as caught:
        trigger()
    assert type(caught.value) is error
    if detail is not None:
        assert re.search(detail, str(caught.value)), str(caught.value)
    assert_same_snapshot(before, cache_snapshot(model))


# ---------------------------------------------------------------------------------------------- no drift
def _catalogue() -> list[tuple[str, list[tuple[str, str]]]]:
    """(row, [(exception type, message fragment), ...]) for each row of the error page's table; a row's first
    cell is ``\\`Type\\`: \\`fragment\\` / \\`fragment\\`; \\`Type\\`: ...``."""
    section = (ROOT / "docs" / "errors.md").read_text()
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        error_cell = line.split(" | ", 1)[0]
        kind, fragments = None, []
        for token in re.findall(r"`([^`]+)`", error_cell):
            if re.fullmatch(r"[A-Z]\w*(Error|Exception)", token):
                kind = token
            else:
                assert kind is not None, f"a fragment before its exception type in {line!r}"
                fragments.append((kind, token))
        rows.append((line, fragments))
    return rows


def _literal(node: ast.AST) -> str:
    """The literal text of a message expression, with a NUL for every computed part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_literal(value) for value in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literal(node.left) + _literal(node.right)
    return "\0"


def _package_raises() -> list[tuple[str, str, list[str]]]:
    """(where, exception type, [message alternatives]) of every ``raise Type(message)`` in the package. Left out:
    bare re-raises in cleanup handlers and ``raise NotImplementedError`` of abstract engine hooks (no message)."""
    found = []
    for path in sorted((ROOT / "diffusers_causal_kv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or not isinstance(node.exc, ast.Call):
                continue
            message = node.exc.args[0]
            alternatives = [message.body, message.orelse] if isinstance(message, ast.IfExp) else [message]
            found.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.exc.func.id,
                          [_literal(m) for m in alternatives]))
    return found


def test_readme_rows_and_cases_match():
    rows = _catalogue()
    assert len(rows) > 40
    assert all(fragments for _, fragments in rows), [line for line, fragments in rows if not fragments]
    documented = [pair for _, fragments in rows for pair in fragments]
    assert len(documented) == len(set(documented)), "a fragment listed twice"
    tested = {(p.values[1].__name__, p.values[2]) for p in CASES}
    assert sorted(set(documented) - tested) == [], "error page rows without a triggering case"
    assert sorted(tested - set(documented)) == [], "cases whose error is not on the error page"
    ids = [p.id for p in CASES]
    assert len(ids) == len(set(ids))


def test_every_raise_in_the_package_has_a_row():
    documented = [pair for _, fragments in _catalogue() for pair in fragments]
    raises = _package_raises()
    assert len(raises) > 80
    missing = [(where, kind, text) for where, kind, texts in raises for text in texts
               if not any(kind == k and fragment in text for k, fragment in documented)]
    assert missing == [], "raises with no row on the error page"
    unused = [(k, fragment) for k, fragment in documented
              if not any(kind == k and fragment in text for _, kind, texts in raises for text in texts)]
    assert unused == [], "error page fragments that no raise in the package contains"
