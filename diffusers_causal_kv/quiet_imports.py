"""diffusers imports its optional quantization backends on import; on a machine without their kernels (a CPU,
another CUDA), torchao and torch log warnings that say nothing about this package ("Failed to load ... .so", an Enum
deprecation, diffusers' "Unable to import `torchao` Tensor objects"), and transformers warns once that its
``CLIPImageProcessor`` (which diffusers' Wan encoder blocks import) falls back to PIL without torchvision. Import them
once here with those loggers raised to ERROR, so that ``import diffusers_causal_kv`` prints nothing; they log as
usual afterwards (transformers' warning is once per process, so it stays quiet)."""

import logging
from contextlib import contextmanager

_NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer",
                  "bitsandbytes", "transformers.utils.import_utils")


@contextmanager
def _quiet(names=_NOISY_LOGGERS):
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


with _quiet():
    import diffusers.quantizers  # noqa: E402,F401  (imports torchao when it is installed)
    from transformers import CLIPImageProcessor  # noqa: E402,F401  (its torchvision warning, once)
