"""``python -m diffusers_causal_kv.convert SRC OUT [options]``: the command line of :func:`convert_checkpoint`."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .checkpoint import DEFAULT_SHARD_SIZE, DTYPES, LORA_MODES, convert_checkpoint
from .peers import FORMAT_NAMES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m diffusers_causal_kv.convert",
        description="Convert a causal Wan checkpoint (Self-Forcing, Causal-Forcing and Causal-Forcing++, CausVid, "
                    "LongLive 1 and 2, Krea, Rolling Forcing, FastVideo's CausalWan2.2-I2V-A14B, original Wan "
                    "layout) into a diffusers WanTransformer3DModel "
                    "folder (two, transformer/ and transformer_2/, for a Wan2.2 A14B model) with its "
                    "causal_config.json.",
    )
    parser.add_argument("src", help="the checkpoint file (.pt, .safetensors, *.safetensors.index.json) or folder (a "
                                    "folder of two Wan2.2 A14B experts: transformer/ and transformer_2/, or "
                                    "high_noise_model/ and low_noise_model/)")
    parser.add_argument("out", help="the diffusers folder to write (written beside it first, moved into place when "
                                    "complete and checked)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing, non-empty OUT whole (none of its files survives)")
    parser.add_argument("--format", default="auto", choices=FORMAT_NAMES,
                        help="the checkpoint's origin (default: from its layout, then its file's own name, then its "
                             "folder's name; the choice and its reason are printed)")
    parser.add_argument("--ema", action=argparse.BooleanOptionalAction, default=None,
                        help="convert generator_ema (--ema) or generator (--no-ema); default: what the peer's "
                             "inference loads")
    parser.add_argument("--lora", help="a LoRA file to apply (LongLive's lora.pt)")
    parser.add_argument("--lora-mode", default="merge", choices=LORA_MODES,
                        help="merge the LoRA into the weights, or write it as a switchable adapter")
    parser.add_argument("--lora-alpha", type=float, help="the LoRA alpha (default: its rank, as LongLive's)")
    parser.add_argument("--base", help="for a LoRA-only SRC (one LoRA, or a folder of the two experts' LoRAs): the "
                                       "checkpoint it was trained on (for two experts, the folder of both)")
    parser.add_argument("--dtype", choices=list(DTYPES),
                        help="cast the weights (default: as stored; bfloat16 for weights dequantized from fp8)")
    parser.add_argument("--max-shard-size", default=DEFAULT_SHARD_SIZE,
                        help=f"largest safetensors shard (default: {DEFAULT_SHARD_SIZE})")
    parser.add_argument("--num-attention-heads", type=int, help="heads (default: width / 128, as every Wan release)")
    parser.add_argument("--attention-head-dim", type=int, help="head dim (default: 128)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a sampling setting of causal_config.json (a JSON value), e.g. chunk_frames=1; "
                             "repeat for several")
    return parser


def _sampling_changes(parser: argparse.ArgumentParser, items: list[str]) -> dict | None:
    changes = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--set takes KEY=VALUE, got {item!r}")
        try:
            changes[key] = json.loads(value)
        except ValueError:
            changes[key] = value  # a bare string, e.g. context_noise_mode=renoise
    return changes or None


def main(argv: list[str] | None = None) -> int:
    """Run the conversion; progress (the format chosen and why, each folder written) goes to stderr, the folder to
    stdout. An error is one line on stderr, ``error: ...``, and exit status 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    causal_config = _sampling_changes(parser, args.set)
    package_logger = logging.getLogger(__package__)
    progress = logging.StreamHandler(sys.stderr)
    progress.setFormatter(logging.Formatter("%(message)s"))
    level, propagate = package_logger.level, package_logger.propagate
    package_logger.addHandler(progress)
    package_logger.setLevel(logging.INFO)
    package_logger.propagate = False
    try:
        out = convert_checkpoint(
            args.src, args.out, args.format, ema=args.ema, lora=args.lora, lora_mode=args.lora_mode,
            lora_alpha=args.lora_alpha, base=args.base, dtype=args.dtype, max_shard_size=args.max_shard_size,
            num_attention_heads=args.num_attention_heads, attention_head_dim=args.attention_head_dim,
            causal_config=causal_config, overwrite=args.overwrite,
        )
    except (ValueError, OSError, RuntimeError) as error:  # bad input, a file system error, a failed check
        print("error: " + " ".join(str(error).split()), file=sys.stderr)
        return 1
    finally:
        package_logger.removeHandler(progress)
        package_logger.setLevel(level)
        package_logger.propagate = propagate
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
