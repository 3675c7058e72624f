"""LoRA adapters over HTTP, with vLLM's names: a client picks one as the request's ``model``
(``/v1/models`` lists them, each with ``parent`` the base model), and an operator loads and
unloads them at run time.

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "sql-v2"}   -> {"lora_name": ..}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}                          -> {"lora_name": ..}

Both are operator routes (auth.ADMIN_PATHS: the admin key when set) and run on the engine thread
between steps. Loading reads files on the server's disk, so it is off unless the server was
started with ``--lora-root DIR``: ``lora_path`` is then a path inside DIR (a relative one is taken from DIR;
one that leaves DIR, through ``..`` or a link, is a 400). Without it both routes answer 403.
A name already loaded is a 409 unless ``"replace": true`` (or vLLM's ``"load_inplace": true``;
vLLM's optional ``lora_int_id`` on unload is accepted, the adapter found by its name); what the
adapter files get wrong (unsupported, too large for the pool) is a 400 naming ``lora_path``.
Requests running with an adapter when it is unloaded or replaced finish with the weights they
started with.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from vmemkv.runtime.engine.errors import EngineConfigError
from vmemkv.runtime.lora import LoraError

from .engine_thread import EngineThread
from .errors import ApiError
from .protocol import parse_model


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    replace: bool = False
    load_inplace: bool = False    # vLLM's name for replace (a vLLM client's body was a 400)


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: Optional[int] = None   # vLLM's optional id; vLLM finds it by lora_name too


def adapter_path(root: Optional[Path], lora_path: str) -> Path:
    """``lora_path`` resolved inside ``root`` (links followed), or ApiError 400 naming it."""
    if "\x00" in lora_path:          # (resolve raised ValueError on it: a 500)
        raise ApiError(400, "lora_path holds a NUL byte", "lora_path")
    try:                             # a name over NAME_MAX, a loop of links, no permission
        path = (root / lora_path).resolve()
        inside = [path] + (sorted(f.resolve() for f in path.iterdir()) if path.is_dir() else [])
    except OSError as error:         # (ENAMETOOLONG from is_dir was a 500)
        raise unreadable(lora_path, error.strerror or type(error).__name__) from None
    except RuntimeError:             # Python < 3.13's resolve() on a loop of links
        raise unreadable(lora_path, "a loop of symbolic links") from None
    for target in inside:          # the folder, and each file in it (a link to a file too)
        if target != root and root not in target.parents:
            raise ApiError(400, f"lora_path must lie inside the server's --lora-root; "
                                f"{lora_path!r} leaves it", "lora_path")
    return path


def add_lora_routes(app: FastAPI, server: EngineThread, lora_root: Optional[Path],
                    served_name: str = "") -> None:
    """The routes above on ``app`` (``lora_root``: None turns runtime loading off;
    ``served_name``: the base model's id, which no adapter may take)."""
    root = None if lora_root is None else Path(lora_root).resolve()

    def enabled() -> Path:
        if root is None:
            raise ApiError(403, "loading LoRA adapters at run time is off; start the server "
                                "with --lora-root DIR to allow adapters from DIR")
        return root

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> dict:
        req = parse_model(await request.body(), LoadLoraRequest)
        path = adapter_path(enabled(), req.lora_path)
        if req.lora_name == served_name:     # its requests would get the base model
            raise ApiError(400, f"lora_name {req.lora_name!r} is the served model's id; give "
                                f"the adapter another name", "lora_name")

        replace = req.replace or req.load_inplace

        def work(engine) -> None:
            if req.lora_name in engine.loras and not replace:
                raise _Conflict(f"an adapter named {req.lora_name!r} is loaded; unload it "
                                f"first or send \"replace\": true")
            engine.add_lora(req.lora_name, path, replace=replace)
        await _on_engine(server.call(work), "lora_path")
        return {"lora_name": req.lora_name}

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> dict:
        req = parse_model(await request.body(), UnloadLoraRequest)
        enabled()
        await _on_engine(server.call(lambda engine: engine.remove_lora(req.lora_name)),
                         "lora_name")
        return {"lora_name": req.lora_name}


def unreadable(lora_path: str, reason: str) -> ApiError:
    """400 naming lora_path: the server's disk cannot read it (the OS's reason, no traceback)."""
    return ApiError(400, f"lora_path {lora_path[:80]!r}{'...' if len(lora_path) > 80 else ''} "
                         f"cannot be read: {reason}", "lora_path")


class _Conflict(Exception):
    """The engine's state refuses the call (a 409)."""


async def _on_engine(future, param: str):
    try:
        return await asyncio.wrap_future(future)
    except _Conflict as error:
        raise ApiError(409, str(error), "lora_name") from None
    except (LoraError, EngineConfigError) as error:
        raise ApiError(400, str(error), param) from None
