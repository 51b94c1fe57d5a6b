"""`sparsex serve`: the OpenAI-compatible server from the command line, and the engine flags every
engine-running subcommand shares (`add_engine_args`, derived from EngineConfig / ReuseConfig).

`python -m sparsex.entrypoints.serve_cli ...` works on its own too.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import threading
from typing import Any

from sparsex.arg_types import positive_int
from sparsex.config import EngineConfig, ReuseConfig, engine_knob_names, knob_field, knob_meta, reuse_knob_names
from sparsex.entrypoints.tool_parsers import PARSER_NAMES
from sparsex.knob_args import add_knob_arg, knob_help
from sparsex.reuse_profiles import ReuseProfiles, find_reuse_profiles
from sparsex.reuse_profiles import engine_config as reuse_engine_config

DEFAULT_MODEL = EngineConfig.model
ENGINE_GROUP, REUSE_GROUP, ADVANCED_GROUP = "engine", "segment reuse", "advanced segment reuse"


def engine_fields(skip: tuple[str, ...] = ("model",)) -> list[tuple[type, dataclasses.Field]]:
    """(owner class, field) of every engine knob, EngineConfig's first (without the nested `reuse`)."""
    out = [(EngineConfig, f) for f in dataclasses.fields(EngineConfig)
           if f.name in engine_knob_names() and f.name not in skip]
    return out + [(ReuseConfig, f) for f in dataclasses.fields(ReuseConfig)]


def add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
    """One flag per EngineConfig / ReuseConfig field (`add_knob_arg`), in three groups: engine,
    segment reuse and advanced segment reuse. `skip`: fields the caller adds itself."""
    groups = {name: p.add_argument_group(name) for name in (ENGINE_GROUP, REUSE_GROUP, ADVANCED_GROUP)}
    for cls, f in engine_fields(skip):
        advanced = knob_meta(f)["advanced"]
        group = groups[ADVANCED_GROUP if advanced else REUSE_GROUP if cls is ReuseConfig else ENGINE_GROUP]
        add_knob_arg(group, cls, f.name)


def engine_knobs(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The engine knobs among parsed arguments, by field name (what `LLM(**knobs)` takes)."""
    names = engine_knob_names() + reuse_knob_names()
    return {n: getattr(args, n) for n in names if hasattr(args, n) and n not in skip}


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("SPARSEX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* and /tokenize (default: $SPARSEX_API_KEY)")
    g.add_argument("--max-queued-requests", type=positive_int, default=None,
                   help="answer 503 + Retry-After when this many requests are already waiting")
    g.add_argument("--tenant-header", default=None,
                   help="request header naming the tenant (e.g. X-Tenant-ID): tenants never share cached KV")
    g.add_argument("--allow-shared-segments", action="store_true",
                   help="accept content parts marked cache_segment.scope='shared' (cross-tenant reuse)")
    g.add_argument("--allow-reuse-overrides", action="store_true",
                   help="accept a request body's `reuse` (per-request segment-reuse knobs; they change what the "
                        "shared segment index keeps): off by default, a request with `reuse` is a 400")
    g.add_argument("--tool-call-parser", default=None, choices=PARSER_NAMES, metavar="NAME",
                   help="how tool calls are written in the model's answers: " + ", ".join(PARSER_NAMES)
                        + " (default: detected from the chat template)")
    g.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's)")
    g.add_argument("--shutdown-timeout", type=float, default=None,
                   help="on SIGTERM, seconds to wait for in-flight requests before closing them (default: wait)")
    g.add_argument("--torch-threads", type=positive_int, default=None,
                   help="torch intra-op threads (default: torch's choice); lower it on shared machines")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve a model over an OpenAI-compatible HTTP API (see docs/server.md).")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=knob_help(knob_field(EngineConfig, "model")))
    add_engine_args(p)
    add_reuse_profile_file_arg(p.add_argument_group(REUSE_GROUP))
    add_server_args(p)
    p.set_defaults(func=run_serve)
    return p


def add_reuse_profile_file_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--reuse-profile-file", default=None, metavar="PATH",
                   help="the reuse profiles' knobs from this `sparsex calibrate` file (default: the model's "
                        "calibrated file in $SPARSEX_PROFILE_DIR or ~/.cache/sparsex/profiles if there is one, "
                        "else the built-in profiles; 'none': built-in)")


def reuse_profiles(args: argparse.Namespace) -> ReuseProfiles:
    """The profile table the engine of these arguments uses (built-in unless segment reuse is on)."""
    if args.cache != "sparsex":
        return ReuseProfiles.builtin()
    return find_reuse_profiles(args.model, getattr(args, "reuse_profile_file", None), seed=args.seed)


def engine_config(args: argparse.Namespace, profiles: ReuseProfiles | None = None) -> EngineConfig:
    return reuse_engine_config(profiles or ReuseProfiles.builtin(), **engine_knobs(args))


def run_serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from sparsex.entrypoints.async_engine import AsyncLLM
    from sparsex.entrypoints.openai_server import build_app
    from sparsex.entrypoints.settings import ServerSettings

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    try:
        profiles = reuse_profiles(args)
        config = engine_config(args, profiles)
        settings = ServerSettings(api_key=args.api_key, tenant_header=args.tenant_header,
                                  allow_shared_segments=args.allow_shared_segments,
                                  allow_reuse_overrides=args.allow_reuse_overrides,
                                  served_model_name=args.served_model_name,
                                  tool_call_parser=args.tool_call_parser)
    except ValueError as e:
        print(f"sparsex serve: {e}", file=sys.stderr)
        return 2
    # the engine logs the reuse knobs in force and the profiles' source (file or built-in) as it starts
    engine = AsyncLLM.from_config(config, reuse_profiles=profiles, max_queued_requests=args.max_queued_requests)
    app = build_app(engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    threading.Thread(target=_exit_when_engine_dies, args=(engine, server), name="sparsex-engine-watch",
                     daemon=True).start()
    server.run()            # SIGINT / SIGTERM: stop accepting, finish in-flight requests, drain, exit
    if engine.error is not None:
        print(f"sparsex serve: the engine died: {engine.error}", file=sys.stderr)
        return 1
    return 0


def _exit_when_engine_dies(engine, server) -> None:
    """A dead engine loop (a lost tensor-parallel rank, a device error) serves nothing again: stop the
    server, so its supervisor sees the exit instead of a server that answers 503 forever."""
    engine.join()
    if engine.error is not None:
        logging.getLogger("sparsex.serve").error("the engine loop died (%r): stopping the server", engine.error)
        server.should_exit = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparsex")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
