"""The rollout planner: the one place where a causal rollout is turned into transformer forwards.

:class:`RolloutPlanner` owns what every sampling loop of the package shares: the chunk schedule (:meth:`plan`), the
per-frame inputs sliced per chunk (Wan2.1 I2V condition latents, VACE control), the engine map it reads and writes,
the pre-flight check of a whole rollout (:meth:`check`, before anything is cleared or committed), clearing, one
forward per chunk and tag under its :class:`~diffusers_causal_kv.CausalContext`, classifier-free guidance over the
``"pos"``/``"neg"`` tags, and commits of a chunk on every tag at once. ``causal_rollout``, ``self_forcing_rollout``,
``prefill`` and ``StreamingRollout`` drive it; they only decide what to denoise.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from .ambient import cfg_ranks
from .causal_config import CONTEXT_NOISE_MODES
from .context import CausalContext
from .masks import chunk_schedule
from .model import (
    check_forward_inputs,
    check_rollout,
    clear_caches,
    commits_together,
    experts_of,
    prepare_transformer,
    resolve_engines,
    topology,
)
from .noise import NoiseSource
from .sharding import row_split


def check_context_noise(context_noise: float, mode: str) -> None:
    """Refuse a commit timestep outside 0..1000 or an unknown ``context_noise_mode``."""
    if mode not in CONTEXT_NOISE_MODES:
        raise ValueError(f"context_noise_mode must be 'label' or 'renoise', got {mode!r}.")
    if not 0 <= context_noise <= 1000:
        raise ValueError(f"context_noise is a timestep in [0, 1000], got {context_noise!r}.")


@dataclass(frozen=True)
class Chunk:
    """One chunk of a plan: ``offset`` into the rollout's own frames, ``size`` frames, starting at absolute latent
    frame ``frame`` of the cache."""

    offset: int
    size: int
    frame: int


def resolve_transformer(model) -> torch.nn.Module:
    """The transformer of a pipeline (its first expert), or ``model`` itself."""
    return experts_of(model)[0]


def expert_engine_maps(experts: list[torch.nn.Module], cache_engines: dict | None) -> list[dict | None]:
    """Each expert's ``cache_engines``: one branch map for one expert; for two experts ``None`` (their own
    ``kv_cache_engines``) or ``{"transformer": map, "transformer_2": map}``."""
    if len(experts) == 1:
        return [cache_engines]
    if cache_engines is None:
        return [None, None]
    if set(cache_engines) != {"transformer", "transformer_2"}:
        raise ValueError(
            "a two-expert pipeline takes cache_engines={'transformer': {...}, 'transformer_2': {...}} (one engine "
            f"map per expert: each caches K/V computed with its own weights), got keys {sorted(cache_engines)}."
        )
    return [cache_engines["transformer"], cache_engines["transformer_2"]]


@dataclass
class Expert:
    """One transformer of a rollout, with its engine map and guidance scale."""

    transformer: torch.nn.Module
    cache_engines: dict | None
    guidance_scale: float


class RolloutPlanner:
    """Chunked, cached forwards of one transformer (or the two experts of Wan2.2 A14B) for one conditioning.

    Args:
        model: a Wan (or Wan VACE) transformer with ``CausalWanAttnProcessor`` installed, or a pipeline holding one
            (or two: ``transformer`` at high noise, ``transformer_2`` below the boundary timestep).
        prompt_embeds: text embeddings of the tag ``cache_tag`` (``"pos"`` by default; :func:`prefill` names
            another tag to fill one tag alone).
        negative_prompt_embeds / guidance_scale: with ``guidance_scale != 1``, classifier-free guidance runs the
            negative prompt through the tag ``"neg"``.
        image_embeds: Wan2.1 I2V image-encoder embeddings, passed to every forward.
        condition_latents / control_latents: per-frame inputs (I2V condition, VACE control) covering the rollout's
            frames, sliced per chunk; ``control_scale`` the per-VACE-layer scale.
        cache_engines: the engine map to use; default ``transformer.kv_cache_engines`` (two experts:
            ``{"transformer": map, "transformer_2": map}``).
        generator: random generator of re-noising: one ``torch.Generator``, one per sample (a list), or a
            :class:`~diffusers_causal_kv.noise.NoiseSource`.
        attention_kwargs: passed to every forward (e.g. ``{"scale": 0.5}``, the LoRA scale).
        guidance_scale_2 / boundary_ratio: two experts: the low-noise expert's guidance scale (default
            ``guidance_scale``) and the boundary (default the pipeline's ``config.boundary_ratio``): a forward at
            timestep ``t >= boundary_ratio * 1000`` runs ``transformer``, below it ``transformer_2``, as the stock
            pipelines choose on the timestep actually passed. Commits run on both experts, all or none.
        expand_timesteps / first_frame_latents: Wan2.2 TI2V (default the pipeline's ``config.expand_timesteps``):
            per-token timesteps; with ``first_frame_latents`` (the encoded image, ``[batch, channels, 1, h, w]``),
            latent frame 0 is that image, its tokens at timestep 0, blended into every forward's input and into
            the chunk's result, as ``WanImageToVideoPipeline(expand_timesteps=True)`` does.
        cfg_batch: with guidance on one device (no ``CFGAcrossRanks``, no context parallelism), run a chunk's
            ``cache_tag`` and ``"neg"`` passes, denoising and commit, as one forward over a batch of the two tags
            (each half of the batch reads and commits its own tag; equal to the two forwards). ``False``: two
            forwards. Prompts of different shapes always run as two forwards.
    """

    def __init__(self, model, prompt_embeds: torch.Tensor, *, negative_prompt_embeds: torch.Tensor | None = None,
                 guidance_scale: float = 1.0, cache_tag: str = "pos", image_embeds: torch.Tensor | None = None,
                 condition_latents: torch.Tensor | None = None, control_latents: torch.Tensor | None = None,
                 control_scale: torch.Tensor | None = None, cache_engines: dict | None = None,
                 generator: torch.Generator | list[torch.Generator] | NoiseSource | None = None,
                 attention_kwargs: dict | None = None,
                 guidance_scale_2: float | None = None, boundary_ratio: float | None = None,
                 expand_timesteps: bool | None = None, first_frame_latents: torch.Tensor | None = None,
                 cfg_batch: bool = True) -> None:
        transformers = experts_of(model)
        if len(transformers) == 2 and transformers[0] is transformers[1]:
            raise ValueError("transformer_2 is the same module as transformer; the two experts of Wan2.2 A14B are two "
                             "models, each with its own cache (pass transformer_2=None for one expert).")
        config = getattr(model, "config", None) if hasattr(model, "transformer") else None
        boundary_ratio = getattr(config, "boundary_ratio", None) if boundary_ratio is None else boundary_ratio
        if len(transformers) == 2 and boundary_ratio is None:
            raise ValueError("a two-expert pipeline needs boundary_ratio (the timestep fraction where transformer_2 "
                             "takes over, e.g. 0.875 for Wan2.2 T2V-A14B, 0.9 for I2V-A14B).")
        scales = [guidance_scale, guidance_scale if guidance_scale_2 is None else guidance_scale_2]
        self.experts = [Expert(t, engines, scale) for t, engines, scale in
                        zip(transformers, expert_engine_maps(transformers, cache_engines), scales)]
        self.boundary = None if len(transformers) == 1 else boundary_ratio * 1000
        self.transformer, self.cache_engines = self.experts[0].transformer, self.experts[0].cache_engines
        self.expand_timesteps = bool(getattr(config, "expand_timesteps", False)) if expand_timesteps is None \
            else expand_timesteps
        self.first_frame_latents = first_frame_latents
        self.use_cfg = any(e.guidance_scale != 1.0 for e in self.experts)
        if self.use_cfg and negative_prompt_embeds is None:
            raise ValueError("guidance_scale != 1 needs negative_prompt_embeds (the 'neg' cache tag's conditioning).")
        # Read-only: a prompt switch makes another planner (with_prompts), so no other holder sees a change.
        given = {cache_tag: prompt_embeds, **({"neg": negative_prompt_embeds} if self.use_cfg else {})}
        self.prompts: Mapping[str, torch.Tensor] = MappingProxyType(
            {tag: self._in_model_dtype(embeds) for tag, embeds in given.items()})
        self.cache_tag, self.guidance_scale = cache_tag, guidance_scale
        self.image_embeds = None if image_embeds is None else self._in_model_dtype(image_embeds)
        self.per_frame = {"condition_latents": condition_latents, "control_latents": control_latents}
        # self.cache_engines stays the first expert's map (set above), not the two-expert map given
        self.control_scale, self.noise = control_scale, NoiseSource(generator)
        self.attention_kwargs = attention_kwargs
        self.cfg_batch = cfg_batch
        self._joined_prompts: tuple = ((), None)  # (the prompts, with versions, and their concatenation)

    def with_frames(self, condition_latents: torch.Tensor | None = None,
                    control_latents: torch.Tensor | None = None) -> RolloutPlanner:
        """This planner with other per-frame inputs (a stream's next frames); the prompts are shared, so a prompt
        switch applies to both."""
        planner = copy.copy(self)
        planner.per_frame = {"condition_latents": condition_latents, "control_latents": control_latents}
        return planner

    def with_prompts(self, **prompts: torch.Tensor) -> RolloutPlanner:
        """This planner with other conditioning for the given tags (a prompt switch); ``self`` is unchanged."""
        unknown = sorted(set(prompts) - set(self.prompts))
        if unknown:
            raise ValueError(f"with_prompts: tags {unknown} are not this rollout's tags {sorted(self.prompts)}.")
        planner = copy.copy(self)
        planner.prompts = MappingProxyType({**self.prompts, **{t: self._in_model_dtype(p) for t, p in prompts.items()}})
        planner._joined_prompts = ((), None)
        return planner

    def for_tag(self, cache_tag: str, prompt_embeds: torch.Tensor, engine_maps: list[dict] | None = None
                ) -> RolloutPlanner:
        """This planner committing ``cache_tag`` alone under ``prompt_embeds`` (no guidance), into ``engine_maps``
        (one per expert; default the planner's): how one tag is re-cached with the rollout's other inputs."""
        planner = copy.copy(self)
        planner.prompts = MappingProxyType({cache_tag: self._in_model_dtype(prompt_embeds)})
        planner.cache_tag, planner.use_cfg, planner._joined_prompts = cache_tag, False, ((), None)
        if engine_maps is not None:
            planner.experts = [Expert(e.transformer, m, e.guidance_scale) for e, m in zip(self.experts, engine_maps)]
            planner.cache_engines = planner.experts[0].cache_engines
        return planner

    def _in_model_dtype(self, embeds: torch.Tensor) -> torch.Tensor:
        """Conditioning in the transformer's dtype, as the stock pipelines pass it (fp32 embeddings of a bf16 model
        would fail in its time projection); the latents keep theirs."""
        dtype = self.transformer.dtype
        return embeds if not embeds.is_floating_point() or embeds.dtype == dtype else embeds.to(dtype)

    @property
    def engines(self) -> dict:
        """The engine map the rollout reads and writes (empty before the transformer's first context)."""
        return resolve_engines(self.transformer, self.cache_engines)

    def next_frame(self) -> int:
        """The absolute frame the tag ``cache_tag`` (with guidance across ranks: this rank's tag) of the ``"main"``
        engine continues at."""
        main = self.engines.get("main")
        cfg = self.cfg_ranks()
        return 0 if main is None else main.next_frame(self.cache_tag if cfg is None else cfg.tag(self.cache_tag))

    def cfg_ranks(self):
        """The open ``CFGAcrossRanks`` when this planner guides (each rank then runs one tag), else ``None``."""
        return cfg_ranks() if self.use_cfg else None

    def plan(self, latents: torch.Tensor, chunk_frames: int | Sequence[int], first_frame: int = 0,
             given: str = "noise") -> list[Chunk]:
        """The chunks over the frames of ``latents`` (``[batch, channels, frames, height, width]``), starting at
        absolute frame ``first_frame``, by :func:`~diffusers_causal_kv.chunk_schedule`; the per-frame inputs must
        cover the same frames (``given``, ``"noise"`` or ``"latents"``, names ``latents`` in the error)."""
        is_vace = topology(self.transformer).is_vace
        if is_vace != (self.per_frame["control_latents"] is not None):
            raise ValueError(
                "a VACE transformer needs control_latents (the control video's latents for every frame)" if is_vace
                else "control_latents were given but the transformer has no VACE blocks; drop them."
            )
        num_frames = latents.shape[2]
        if num_frames == 0:
            raise ValueError(f"{given} has 0 latent frames ({tuple(latents.shape)}); pass at least one frame.")
        for name, per_frame in self.per_frame.items():
            if per_frame is not None and per_frame.shape[2] != num_frames:
                raise ValueError(
                    f"{name} has {per_frame.shape[2]} frames but noise has {num_frames}; they must match."
                    if given == "noise" else f"{name} has {per_frame.shape[2]} frames but latents have {num_frames}."
                )
        chunks, offset = [], 0
        for size in chunk_schedule(num_frames, chunk_frames):
            chunks.append(Chunk(offset, size, first_frame + offset))
            offset += size
        return chunks

    def check(self, latents: torch.Tensor, chunks: list[Chunk]) -> None:
        """Fail before any work if the planned rollout cannot run: inputs the model refuses (checked on the first
        chunk of every tag), a schedule an engine cannot hold, or positions past the RoPE table."""
        first = chunks[0]
        for expert in self.experts:
            for tag in self.prompts:
                check_forward_inputs(expert.transformer, self.inputs(latents[:, :, :first.size], 0.0, tag, first))
        self.check_schedule(first.frame, [c.size for c in chunks])

    def prepare(self) -> None:
        """Complete and validate every expert's engine map (every branch) as the first forward would."""
        for expert in self.experts:
            prepare_transformer(expert.transformer, expert.cache_engines)

    def check_schedule(self, first_frame: int, sizes: list[int]) -> None:
        """Fail before any work if an engine cannot hold chunks of ``sizes`` from ``first_frame`` or their positions
        pass the RoPE table."""
        self.prepare()  # before any clearing
        for expert in self.experts:
            check_rollout(expert.transformer, resolve_engines(expert.transformer, expert.cache_engines), first_frame,
                          sizes)

    def clear(self) -> None:
        """Clear the engines the rollout uses (every expert's)."""
        for expert in self.experts:
            if expert.cache_engines is None:
                clear_caches(expert.transformer)
            else:
                for engine in expert.cache_engines.values():
                    engine.clear()

    def expert_for(self, t) -> Expert:
        """The expert that denoises at timestep ``t``: the one diffusers' ``WanPipeline`` picks, on the value handed
        to the model (``t`` as the float32 timestep tensor of :meth:`inputs`) compared as diffusers compares it
        (``t >= boundary_ratio * num_train_timesteps``, a float32 tensor against a Python float). ``sigma * 1000``
        in double precision can fall just below a boundary its float32 rounding reaches (899.99997 -> 900.0)."""
        if self.boundary is None:
            return self.experts[0]
        timestep = torch.tensor(float(t), dtype=torch.float32)
        return self.experts[0] if bool(timestep >= self.boundary) else self.experts[1]

    def batched_tags(self, expert: Expert) -> tuple[str, ...] | None:
        """The tags one forward of ``expert`` runs as a batch (guidance on one device, ``cfg_batch``), or ``None``
        when each tag runs its own forward."""
        if not (self.use_cfg and self.cfg_batch) or self.cfg_ranks() is not None or (
                row_split(expert.transformer) is not None):
            return None
        tags = (self.cache_tag, "neg")
        prompts = [self.prompts[tag] for tag in tags]
        return tags if prompts[0].shape == prompts[1].shape else None

    def _prompts_of(self, tags: tuple[str, ...]) -> torch.Tensor:
        """The tags' prompts joined along the batch: one tensor while the prompts are unchanged, so that the
        transformer hook fingerprints it once."""
        prompts = tuple(self.prompts[tag] for tag in tags)
        key = tuple((id(p), None if p.is_inference() else p._version) for p in prompts)
        known, joined = self._joined_prompts
        if known != key or any(p.is_inference() for p in prompts):
            joined = torch.cat(prompts)
            self._joined_prompts = (key, joined)
        return joined

    def inputs(self, x: torch.Tensor, t, tag: str | tuple[str, ...], chunk: Chunk) -> dict:
        """The transformer's keyword arguments for the chunk's latents ``x`` at timestep ``t`` on ``tag`` (a tuple:
        one batch of every tag's inputs, in order)."""
        if isinstance(tag, tuple):
            inputs = self.inputs(x, t, tag[0], chunk)
            for name in ("hidden_states", "timestep", "encoder_hidden_states_image", "control_hidden_states"):
                if inputs.get(name) is not None:
                    inputs[name] = torch.cat([inputs[name]] * len(tag))
            inputs["encoder_hidden_states"] = self._prompts_of(tag)
            return inputs
        part = {k: None if v is None else v[:, :, chunk.offset:chunk.offset + chunk.size]
                for k, v in self.per_frame.items()}
        condition = part["condition_latents"]
        x = self.with_first_frame(x, chunk)
        inputs = {
            # in the transformer's dtype, as the stock pipelines pass it (the latents stay in theirs)
            "hidden_states": (x if condition is None else torch.cat([x, condition], dim=1)).to(self.transformer.dtype),
            "timestep": self._timestep(x, t, chunk),
            "encoder_hidden_states": self.prompts[tag],
            "encoder_hidden_states_image": self.image_embeds,
            "attention_kwargs": self.attention_kwargs,
        }
        if part["control_latents"] is not None:
            inputs.update(control_hidden_states=part["control_latents"], control_hidden_states_scale=self.control_scale)
        return inputs

    def _timestep(self, x: torch.Tensor, t, chunk: Chunk) -> torch.Tensor:
        """One timestep per sample, or per token (Wan2.2 TI2V; or ``t`` a 1-D tensor of one timestep per latent
        frame, the rolling-forcing window): ``t`` everywhere, 0 on a conditioning first frame."""
        frame_steps = isinstance(t, torch.Tensor) and t.ndim == 1
        if not (self.expand_timesteps or frame_steps):
            return torch.full((x.shape[0],), float(t), device=x.device, dtype=torch.float32)
        _, p_h, p_w = self.transformer.config.patch_size
        per_frame = (x.shape[3] // p_h) * (x.shape[4] // p_w)
        shape = (x.shape[0], x.shape[2], per_frame)
        timestep = t.to(x.device, torch.float32)[None, :, None].expand(shape).clone() if frame_steps else \
            torch.full(shape, float(t), device=x.device, dtype=torch.float32)
        if self.first_frame_latents is not None and chunk.frame == 0:
            timestep[:, 0] = 0
        return timestep.flatten(1)

    def with_first_frame(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """``x`` with latent frame 0 replaced by the conditioning image (TI2V image-to-video, the chunk holding
        frame 0 only), as the stock pipeline blends it: ``(1 - mask) * condition + mask * latents``."""
        if self.first_frame_latents is None or chunk.frame != 0:
            return x
        mask = torch.ones_like(x[:, :1])
        mask[:, :, 0] = 0
        return (1 - mask) * self.first_frame_latents.to(x.dtype) + mask * x

    def forward(self, x: torch.Tensor, t, chunk: Chunk, tag: str | tuple[str, ...], store_kv: bool = False,
                expert: Expert | None = None) -> torch.Tensor:
        """One transformer forward on a chunk under its :class:`CausalContext` (the expert of timestep ``t``); a
        tuple of tags runs them as one batch and returns their outputs joined in that order."""
        expert = self.expert_for(t) if expert is None else expert
        with CausalContext(expert.transformer, start_frame=chunk.frame, cache_tag=tag, store_kv=store_kv,
                           cache_engines=expert.cache_engines):
            return expert.transformer(**self.inputs(x, t, tag, chunk), return_dict=False)[0]

    def flow(self, x: torch.Tensor, t, chunk: Chunk) -> torch.Tensor:
        """The (guided) flow prediction for a chunk at timestep ``t``, by the expert of ``t``."""
        # In the latents' dtype: a flow-matching scheduler casts its step to the flow's dtype, and the latents of a
        # bf16 transformer stay in fp32 as in the stock pipelines.
        expert = self.expert_for(t)
        cfg = self.cfg_ranks()
        if cfg is not None:  # this rank runs one tag; the two predictions are combined across ranks
            local = self.forward(x, t, chunk, cfg.tag(self.cache_tag), expert=expert)
            return cfg.combine(local, expert.guidance_scale).to(x.dtype)
        tags = self.batched_tags(expert)
        if tags is not None:
            cond, uncond = self.forward(x, t, chunk, tags, expert=expert).chunk(2)
            return (uncond + expert.guidance_scale * (cond - uncond)).to(x.dtype)
        cond = self.forward(x, t, chunk, self.cache_tag, expert=expert)
        if not self.use_cfg:
            return cond.to(x.dtype)
        uncond = self.forward(x, t, chunk, "neg", expert=expert)
        return (uncond + expert.guidance_scale * (cond - uncond)).to(x.dtype)

    def predict_x0(self, x: torch.Tensor, sigma: float, chunk: Chunk) -> torch.Tensor:
        """The clean chunk the (guided) flow predicts from ``x`` at noise level ``sigma``."""
        return x - sigma * self.flow(x, sigma * 1000, chunk)

    def renoise(self, x0: torch.Tensor, sigma: float) -> torch.Tensor:
        """``x0`` noised to level ``sigma`` with fresh noise (the flow-matching forward process)."""
        return (1 - sigma) * x0 + sigma * self.noise.like(x0)

    def commit(self, x: torch.Tensor, chunk: Chunk, context_noise: float = 0.0, mode: str = "label") -> None:
        """Commit a clean chunk on every tag (all or none) with the timestep label ``context_noise`` (0..1000).

        ``mode="label"`` commits the clean chunk as it is (the peers' inference); ``mode="renoise"`` first noises it
        to the level ``context_noise`` with fresh noise from the generator (the peers' training code). The two are
        the same at ``context_noise=0``."""
        check_context_noise(context_noise, mode)
        if mode == "renoise" and context_noise > 0:
            x = self.renoise(x, context_noise / 1000)
        cfg = self.cfg_ranks()
        tags = list(self.prompts) if cfg is None else [cfg.tag(self.cache_tag)]
        # Every expert's cache needs the K/V of its own weights; with guidance across ranks, every rank's tag.
        with torch.no_grad(), commits_together(None if cfg is None else cfg.commit_group):
            for expert in self.experts:
                batched = self.batched_tags(expert)
                for tag in tags if batched is None else [batched]:
                    self.forward(x, context_noise, chunk, tag, store_kv=True, expert=expert)
