"""The causal block sets: the stock Wan core denoise steps with the causal denoise step in place, the stock sets
turned into block sets of their own classes, and how they are saved so that diffusers reloads them (see the package
docstring)."""

from __future__ import annotations

import copy
import os
import tempfile

from diffusers.modular_pipelines import ModularPipelineBlocks, SequentialPipelineBlocks
from diffusers.modular_pipelines.modular_pipeline_utils import OutputParam
from diffusers.modular_pipelines.wan.before_denoise import (
    WanAdditionalInputsStep,
    WanPrepareLatentsStep,
    WanTextInputStep,
    WanVaceAdditionalInputsStep,
)
from diffusers.modular_pipelines.wan.decoders import WanVaceTrimReferenceLatentsStep
from diffusers.modular_pipelines.wan.encoders import WanTextEncoderStep, WanVaceEncoderStep
from diffusers.modular_pipelines.wan.modular_blocks_wan import WanBlocks, WanCoreDenoiseStep
from diffusers.modular_pipelines.wan.modular_blocks_wan22 import Wan22Blocks, Wan22CoreDenoiseStep
from diffusers.modular_pipelines.wan.modular_blocks_wan22_i2v import (
    Wan22Image2VideoBlocks,
    Wan22Image2VideoCoreDenoiseStep,
)
from diffusers.modular_pipelines.wan.modular_blocks_wan_i2v import (
    WanImage2VideoAutoBlocks,
    WanImage2VideoCoreDenoiseStep,
)
from diffusers.modular_pipelines.wan.modular_blocks_wan_vace import Wan22VaceBlocks, Wan22VaceCoreDenoiseStep

from .denoise import (
    CausalWan22DenoiseStep,
    CausalWan22Image2VideoDenoiseStep,
    CausalWan22VaceDenoiseStep,
    CausalWanDenoiseStep,
    CausalWanImage2VideoDenoiseStep,
)
from .encoders import CausalWanTextEncoderStep, CausalWanVaceEncoderStep


class CausalWanCoreDenoiseStep(SequentialPipelineBlocks):
    """Causal replacement of ``WanCoreDenoiseStep`` (``WanBlocks.sub_blocks["denoise"]``): the stock input and
    prepare-latents steps, then :class:`CausalWanDenoiseStep`."""

    model_name = "wan"
    block_classes = [WanTextInputStep, WanPrepareLatentsStep, CausalWanDenoiseStep]
    block_names = ["input", "prepare_latents", "denoise"]

    @property
    def description(self):
        return "Causal denoise block: takes encoded conditions and denoises the video chunk by chunk with a KV cache."

    @property
    def outputs(self):
        return [OutputParam.template("latents")]


class CausalWanImage2VideoCoreDenoiseStep(SequentialPipelineBlocks):
    """Causal replacement of ``WanImage2VideoCoreDenoiseStep`` (``WanImage2VideoAutoBlocks.sub_blocks["denoise"]``):
    the stock input steps (text, image condition latents) and prepare-latents step, then
    :class:`CausalWanImage2VideoDenoiseStep`."""

    model_name = "wan-i2v"
    block_classes = [
        WanTextInputStep,
        WanAdditionalInputsStep(image_latent_inputs=["image_condition_latents"]),
        WanPrepareLatentsStep,
        CausalWanImage2VideoDenoiseStep,
    ]
    block_names = ["input", "additional_inputs", "prepare_latents", "denoise"]

    @property
    def description(self):
        return ("Causal denoise block: takes encoded text and image latent conditions and denoises the video chunk "
                "by chunk with a KV cache.")


class CausalWan22CoreDenoiseStep(SequentialPipelineBlocks):
    """Causal replacement of ``Wan22CoreDenoiseStep`` (``Wan22Blocks.sub_blocks["denoise"]``): the stock input and
    prepare-latents steps, then :class:`CausalWan22DenoiseStep`."""

    model_name = "wan"
    block_classes = [WanTextInputStep, WanPrepareLatentsStep, CausalWan22DenoiseStep]
    block_names = ["input", "prepare_latents", "denoise"]

    @property
    def description(self):
        return ("Causal denoise block (Wan2.2, two experts): takes encoded conditions and denoises the video chunk by "
                "chunk with a KV cache per expert.")

    @property
    def outputs(self):
        return [OutputParam.template("latents")]


class CausalWan22Image2VideoCoreDenoiseStep(SequentialPipelineBlocks):
    """Causal replacement of ``Wan22Image2VideoCoreDenoiseStep`` (``Wan22Image2VideoBlocks.sub_blocks["denoise"]``):
    the stock input steps and prepare-latents step, then :class:`CausalWan22Image2VideoDenoiseStep`."""

    model_name = "wan-i2v"
    block_classes = [
        WanTextInputStep,
        WanAdditionalInputsStep(image_latent_inputs=["image_condition_latents"]),
        WanPrepareLatentsStep,
        CausalWan22Image2VideoDenoiseStep,
    ]
    block_names = ["input", "additional_inputs", "prepare_latents", "denoise"]

    @property
    def description(self):
        return ("Causal denoise block (Wan2.2 I2V, two experts): takes encoded text and image latent conditions and "
                "denoises the video chunk by chunk with a KV cache per expert.")

    @property
    def outputs(self):
        return [OutputParam.template("latents")]


class CausalWan22VaceCoreDenoiseStep(SequentialPipelineBlocks):
    """Causal replacement of ``Wan22VaceCoreDenoiseStep`` (``Wan22VaceBlocks.sub_blocks["denoise"]``): the stock input,
    VACE input and prepare-latents steps, :class:`CausalWan22VaceDenoiseStep`, then the stock reference trim step."""

    model_name = "wan-vace"
    block_classes = [
        WanTextInputStep,
        WanVaceAdditionalInputsStep,
        WanPrepareLatentsStep,
        CausalWan22VaceDenoiseStep,
        WanVaceTrimReferenceLatentsStep,
    ]
    block_names = ["input", "additional_inputs", "prepare_latents", "denoise", "trim_latents"]

    @property
    def description(self):
        return ("Causal denoise block (Wan2.2 VACE): takes encoded text and VACE control latents and denoises the "
                "video chunk by chunk with a KV cache per expert.")

    @property
    def outputs(self):
        return [OutputParam.template("latents")]


_CAUSAL_ENCODER_STEPS = {WanTextEncoderStep: CausalWanTextEncoderStep, WanVaceEncoderStep: CausalWanVaceEncoderStep}

_CAUSAL_CORE_STEPS = {
    WanCoreDenoiseStep: CausalWanCoreDenoiseStep,
    WanImage2VideoCoreDenoiseStep: CausalWanImage2VideoCoreDenoiseStep,
    Wan22CoreDenoiseStep: CausalWan22CoreDenoiseStep,
    Wan22Image2VideoCoreDenoiseStep: CausalWan22Image2VideoCoreDenoiseStep,
    Wan22VaceCoreDenoiseStep: CausalWan22VaceCoreDenoiseStep,
}


# How a saved folder finds these classes again. ModularPipeline.save_pretrained writes the components and
# modular_model_index.json, whose "_blocks_class_name" ModularPipeline.from_pretrained looks up in the diffusers
# namespace only, falling back silently to the stock set (WanBlocks...) for a name it does not find. Block sets
# diffusers does not ship load as custom code instead, the mechanism diffusers supports for them: the block set's own
# save_pretrained writes modular_config.json, whose "auto_map" names a module file in the folder and a class in it,
# and ModularPipeline.from_pretrained(folder, trust_remote_code=True) imports that class
# (ModularPipelineBlocks.from_pretrained) and builds the pipeline from it. diffusers leaves writing the module file to
# the author; ours writes it, as one import of the class from the installed package (no code is copied, so the folder
# always runs the installed version, which the causal step needs anyway). Registering the classes in the diffusers
# namespace instead would patch diffusers, and would work only in a process that imported this package first.
_BLOCKS_MODULE_NAME = "causal_wan_blocks"
_BLOCKS_MODULE = '''"""The causal Wan blocks of diffusers-causal-kv (pip install diffusers-causal-kv): load this
folder with ModularPipeline.from_pretrained(folder, trust_remote_code=True)."""

from {module} import {name}  # noqa: F401
'''


class _CausalBlockSet(SequentialPipelineBlocks):
    """A stock Wan block set with the causal steps in place of its stock ones (see :func:`causal_wan_blocks`), saved
    so that ``ModularPipeline.from_pretrained(folder, trust_remote_code=True)`` rebuilds it (not the stock set)."""

    @classmethod
    def _causal_steps(cls, stock: type[SequentialPipelineBlocks]) -> list:
        """The stock set's ``block_classes`` with the causal core denoise step (and VACE encoder step)."""
        causal = {**_CAUSAL_CORE_STEPS, **_CAUSAL_ENCODER_STEPS}
        return [causal.get(block, block) for block in stock.block_classes]

    @property
    def description(self) -> str:
        return (f"{super().description} Causal: the core denoise step denoises the video chunk by chunk of latent "
                "frames with a KV cache (diffusers_causal_kv).")

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs) -> None:
        """Write ``modular_config.json`` (diffusers' ``auto_map`` to this class) and the module file it names into
        ``save_directory`` (created if missing), each replaced whole.

        Save a pipeline with ``pipe.save_pretrained(folder)`` (the components and ``modular_model_index.json``) and
        ``pipe.blocks.save_pretrained(folder)`` (this), then load it with
        ``ModularPipeline.from_pretrained(folder, trust_remote_code=True)``. ``push_to_hub`` and ``kwargs`` as in
        diffusers' ``ModularPipelineBlocks.save_pretrained``.
        """
        # diffusers' own save_pretrained keys auto_map by the class that defines the method it runs (this override,
        # here), where from_pretrained looks for "ModularPipelineBlocks": the entry is written here instead.
        entry = f"{_BLOCKS_MODULE_NAME}.{type(self).__name__}"
        self.register_to_config(auto_map={ModularPipelineBlocks.__name__: entry})
        os.makedirs(save_directory, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=save_directory, prefix=".causal_blocks_") as staging:
            self.save_config(staging)
            with open(os.path.join(staging, f"{_BLOCKS_MODULE_NAME}.py"), "w") as f:
                f.write(_BLOCKS_MODULE.format(module=type(self).__module__, name=type(self).__name__))
            for name in (self.config_name, f"{_BLOCKS_MODULE_NAME}.py"):
                os.replace(os.path.join(staging, name), os.path.join(save_directory, name))
        if push_to_hub:  # the folder is complete: diffusers uploads it with the config
            self.save_config(save_directory, push_to_hub=True, **kwargs)


class CausalWanBlocks(_CausalBlockSet, WanBlocks):
    """``WanBlocks`` (Wan2.1 T2V) with :class:`CausalWanCoreDenoiseStep`."""

    block_classes = _CausalBlockSet._causal_steps(WanBlocks)


class CausalWanImage2VideoAutoBlocks(_CausalBlockSet, WanImage2VideoAutoBlocks):
    """``WanImage2VideoAutoBlocks`` (Wan2.1 I2V and FLF2V) with :class:`CausalWanImage2VideoCoreDenoiseStep`."""

    block_classes = _CausalBlockSet._causal_steps(WanImage2VideoAutoBlocks)


class CausalWan22Blocks(_CausalBlockSet, Wan22Blocks):
    """``Wan22Blocks`` (Wan2.2 T2V) with :class:`CausalWan22CoreDenoiseStep`."""

    block_classes = _CausalBlockSet._causal_steps(Wan22Blocks)


class CausalWan22Image2VideoBlocks(_CausalBlockSet, Wan22Image2VideoBlocks):
    """``Wan22Image2VideoBlocks`` (Wan2.2 I2V-A14B) with :class:`CausalWan22Image2VideoCoreDenoiseStep`."""

    block_classes = _CausalBlockSet._causal_steps(Wan22Image2VideoBlocks)


class CausalWan22VaceBlocks(_CausalBlockSet, Wan22VaceBlocks):
    """``Wan22VaceBlocks`` (VACE) with :class:`CausalWan22VaceCoreDenoiseStep` and :class:`CausalWanVaceEncoderStep`."""

    block_classes = _CausalBlockSet._causal_steps(Wan22VaceBlocks)


_CAUSAL_BLOCK_SETS = {
    WanBlocks: CausalWanBlocks,
    WanImage2VideoAutoBlocks: CausalWanImage2VideoAutoBlocks,
    Wan22Blocks: CausalWan22Blocks,
    Wan22Image2VideoBlocks: CausalWan22Image2VideoBlocks,
    Wan22VaceBlocks: CausalWan22VaceBlocks,
}


def causal_wan_blocks(blocks: SequentialPipelineBlocks | None = None) -> SequentialPipelineBlocks:
    """A copy of a Wan block set whose core denoise step (``sub_blocks["denoise"]``) is causal.

    Args:
        blocks: ``WanBlocks()`` (the default), ``WanImage2VideoAutoBlocks()``, ``Wan22Blocks()``,
            ``Wan22Image2VideoBlocks()`` or ``Wan22VaceBlocks()``, or a block set of your own whose ``"denoise"``
            sub-block is one of their stock core denoise steps; it is copied, not changed.

    Returns:
        The copy, with the causal core denoise step (:class:`CausalWanCoreDenoiseStep`,
        :class:`CausalWanImage2VideoCoreDenoiseStep`, :class:`CausalWan22CoreDenoiseStep`,
        :class:`CausalWan22Image2VideoCoreDenoiseStep` or :class:`CausalWan22VaceCoreDenoiseStep`) as its
        ``"denoise"`` sub-block; its other sub-blocks (image encoders, VAE decoder) are the stock ones, but for the
        text encoder step, which becomes :class:`~diffusers_causal_kv.modular.encoders.CausalWanTextEncoderStep`
        (it also runs without guidance), and the VACE set's ``"vace_encoder"``, which becomes
        :class:`CausalWanVaceEncoderStep` (the causal mask).
        A stock set comes back as its causal subclass (:class:`CausalWanBlocks`,
        :class:`CausalWanImage2VideoAutoBlocks`, :class:`CausalWan22Blocks`,
        :class:`CausalWan22Image2VideoBlocks`, :class:`CausalWan22VaceBlocks`), whose ``save_pretrained`` makes
        a saved pipeline reload with the causal steps; like diffusers' own sets, it reloads with the class's
        sub-blocks, not with sub-blocks added or removed after it was built. A set of your own class stays of
        that class, which diffusers reloads by its name (with that class's own denoise step).
    """
    blocks = WanBlocks() if blocks is None else copy.deepcopy(blocks)
    core = blocks.sub_blocks.get("denoise")
    causal = _CAUSAL_CORE_STEPS.get(type(core))
    if causal is None:
        why = "has no 'denoise' sub-block" if core is None else f"has the denoise step {type(core).__name__}"
        raise NotImplementedError(
            f"{type(blocks).__name__} {why}, which the causal denoise blocks do not cover; they replace the stock "
            "core denoise steps of WanBlocks, WanImage2VideoAutoBlocks, Wan22Blocks, Wan22Image2VideoBlocks and "
            "Wan22VaceBlocks."
        )
    blocks.sub_blocks["denoise"] = causal()
    for name, step in list(blocks.sub_blocks.items()):  # exactly the stock encoder steps (not subclasses of yours)
        if type(step) in _CAUSAL_ENCODER_STEPS:
            blocks.sub_blocks[name] = _CAUSAL_ENCODER_STEPS[type(step)]()
    named = _CAUSAL_BLOCK_SETS.get(type(blocks))
    if named is None:
        return blocks
    made = named()
    made.sub_blocks = blocks.sub_blocks  # the given set's sub-blocks, as given (and made causal)
    return made


def causal_wan_i2v_blocks() -> CausalWanImage2VideoAutoBlocks:
    """``WanImage2VideoAutoBlocks()`` (Wan2.1 I2V and FLF2V) with the causal core denoise step."""
    return causal_wan_blocks(WanImage2VideoAutoBlocks())


def causal_wan22_blocks() -> CausalWan22Blocks:
    """``Wan22Blocks()`` (Wan2.2 T2V: A14B's two experts, or one transformer) with the causal core denoise step."""
    return causal_wan_blocks(Wan22Blocks())


def causal_wan22_i2v_blocks() -> CausalWan22Image2VideoBlocks:
    """``Wan22Image2VideoBlocks()`` (Wan2.2 I2V-A14B: condition latents, no image embeddings) with the causal core
    denoise step."""
    return causal_wan_blocks(Wan22Image2VideoBlocks())


def causal_wan22_vace_blocks() -> CausalWan22VaceBlocks:
    """``Wan22VaceBlocks()`` (VACE: two ``WanVACETransformer3DModel`` experts, or one) with the causal core denoise
    step and the causal control-mask encoder step."""
    return causal_wan_blocks(Wan22VaceBlocks())


