"""``python -m diffusers_causal_kv.serve MODEL``: the stream server (docs/serving.md).

One process serves one pipeline on one device, on 127.0.0.1 unless ``--host`` says otherwise; ``--replicas N`` runs
N replicas on a local Ray Serve instance instead (one pipeline each, on loopback too).
"""

from __future__ import annotations

import argparse
import os
import sys

from .protocol import Limits


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m diffusers_causal_kv.serve", description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a CausalWanPipeline folder (e.g. models/tiny-sprites)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: only this machine)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token", default=os.environ.get("CAUSAL_KV_SERVE_TOKEN"),
                        help="a shared token clients must pass as /ws?token=... (default: $CAUSAL_KV_SERVE_TOKEN, "
                             "else none)")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", help="default: bfloat16 on cuda, float32 elsewhere")
    parser.add_argument("--memory-budget-mib", type=float,
                        help="MiB the sessions' caches may hold together (default: 80%% of the free memory)")
    parser.add_argument("--max-sessions", type=int, default=8)
    parser.add_argument("--no-batching", action="store_true", help="make the sessions' chunks one after another")
    parser.add_argument("--idle-timeout", type=float, default=60.0,
                        help="seconds a client may leave frames unread before its session ends")
    parser.add_argument("--height", type=int, default=480, help="size of a session that asks for none")
    parser.add_argument("--width", type=int, default=832)
    limits = Limits()
    parser.add_argument("--max-height", type=int, default=limits.max_height)
    parser.add_argument("--max-width", type=int, default=limits.max_width)
    parser.add_argument("--max-frames", type=int, help="video frames per session (default: until stopped)")
    parser.add_argument("--max-chunk-frames", type=int, default=limits.max_chunk_frames)
    parser.add_argument("--max-prompt-chars", type=int, default=limits.max_prompt_chars)
    parser.add_argument("--replicas", type=int, default=0,
                        help="serve through a local Ray Serve instance with this many replicas (one pipeline each)")
    parser.add_argument("--gpus-per-replica", type=float, default=0.0)
    args = parser.parse_args(argv)
    positive = ["port", "max_sessions", "idle_timeout", "height", "width", "max_height", "max_width",
                "max_chunk_frames", "max_prompt_chars"]
    for name in positive + ["memory_budget_mib", "max_frames"]:
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}.")
    return args


def options_of(args: argparse.Namespace):
    from .server import ServerOptions

    limits = Limits(max_prompt_chars=args.max_prompt_chars, max_height=args.max_height, max_width=args.max_width,
                    max_frames=args.max_frames, max_chunk_frames=args.max_chunk_frames)
    budget = None if args.memory_budget_mib is None else int(args.memory_budget_mib * 2**20)
    return ServerOptions(budget=budget, max_sessions=args.max_sessions, token=args.token,
                         batched=not args.no_batching, idle_timeout=args.idle_timeout, height=args.height,
                         width=args.width, limits=limits)


def main(argv: list[str] | None = None) -> int:
    """Serve until interrupted. An error loading the model or in the options is one line on stderr, ``error: ...``,
    and exit status 1."""
    args = parse_args(argv)
    options = options_of(args)
    if args.replicas:
        from .ray_deployment import run_local

        run_local(args.model, options, replicas=args.replicas, host=args.host, port=args.port,
                  gpus_per_replica=args.gpus_per_replica, device=args.device, dtype=args.dtype)
        return 0
    import uvicorn

    from .server import create_server, load_pipeline

    try:
        app, loop = create_server(load_pipeline(args.model, args.device, args.dtype), options)
    except (OSError, ValueError) as error:  # no such folder or not a pipeline; a default size past the limits
        print("error: " + " ".join(str(error).split()), file=sys.stderr)
        return 1
    print(f"serving {args.model} on http://{args.host}:{args.port}/ (budget {loop.budget / 2**20:.0f} MiB of cache)",
          flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                    ws_max_size=16 * options.limits.max_message_bytes)  # the parser explains the limit below this
    finally:
        loop.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
