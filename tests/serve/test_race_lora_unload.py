"""An adapter the engine thread unloads between the HTTP side's read of the adapter names and
its read of the adapter itself (for the limits): GET /v1/models leaves it out, GET
/v1/models/{id} answers 404 and a request naming it 404 naming ``model``, as when it is not
loaded at all; never a 500. The unload is made to land exactly in that window: the names'
read on the HTTP side runs the unload on the engine thread before it returns (no sleeps)."""
from __future__ import annotations

import contextlib
import threading

import pytest

pytest.importorskip("peft")

from vmemkv.runtime.engine import Engine  # noqa: E402
from vmemkv.runtime.engine.adapters import EngineAdapters  # noqa: E402
from vmemkv.runtime.serve import Server  # noqa: E402

from ..engine.byte_tokenizer import byte_tokenizer  # noqa: E402
from . import local_http  # noqa: E402
from .conftest import NAME, VMEM  # noqa: E402
from .test_lora import adapter_root, model, post, refused  # noqa: E402,F401

ADAPTER = "one"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
COMPLETION = {"prompt": [5, 17, 101], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def served(adapter_root):
    """(server, engine): the tiny model with a chat-template tokenizer, adapters off."""
    with Engine(model(), byte_tokenizer(chat_template=True), **VMEM) as engine:
        with Server(engine, NAME, host="127.0.0.1", port=0).start() as server:
            yield server, engine


class UnloadInTheWindow:
    """Patched over ``EngineAdapters.names``: the next read of the names off the engine thread
    (the HTTP side's check) has the engine thread unload ``ADAPTER`` before it returns the names
    it read, which still hold it; as the engine thread may at any moment. ``fired``: it did."""

    def __init__(self, server) -> None:
        self.engine_thread = server.engine_thread
        self.engine_thread_id = self.engine_thread.call(lambda _: threading.get_ident()).result()
        self.read_names = EngineAdapters.names.fget
        self.fired = False

    def names(self, adapters) -> list:
        names = self.read_names(adapters)
        if not self.fired and ADAPTER in names and threading.get_ident() != self.engine_thread_id:
            self.fired = True
            self.engine_thread.call(lambda engine: engine.remove_lora(ADAPTER)).result(timeout=60)
        return names


@contextlib.contextmanager
def unloaded_in_the_window(served, adapter_root, monkeypatch):
    server, engine = served
    server.engine_thread.call(lambda e: e.add_lora(ADAPTER, str(adapter_root / ADAPTER))).result()
    window = UnloadInTheWindow(server)
    monkeypatch.setattr(EngineAdapters, "names", property(window.names))
    yield server
    assert window.fired and engine.loras == []     # the unload did land in the window


def test_models_listing_leaves_out_an_adapter_unloaded_while_it_reads(served, adapter_root,
                                                                       monkeypatch):
    base = local_http.get(served[0].url + "/v1/models", timeout=60).json()["data"]
    with unloaded_in_the_window(served, adapter_root, monkeypatch) as server:
        response = local_http.get(server.url + "/v1/models", timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["data"] == base and [m["id"] for m in base] == [NAME]


def test_model_retrieve_of_an_adapter_unloaded_while_it_reads_is_404(served, adapter_root,
                                                                     monkeypatch):
    with unloaded_in_the_window(served, adapter_root, monkeypatch) as server:
        response = local_http.get(server.url + f"/v1/models/{ADAPTER}", timeout=60)
    message = refused(response, 404, "model")
    assert message == f"model {ADAPTER!r} is not served here; this server serves [{NAME!r}]"


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
def test_request_naming_an_adapter_unloaded_after_its_check_is_404_model(
        served, adapter_root, monkeypatch, path, body):
    with unloaded_in_the_window(served, adapter_root, monkeypatch) as server:
        response = post(server, path, {**body, "model": ADAPTER})
    message = refused(response, 404, "model")
    assert message == f"model {ADAPTER!r} is not served here; this server serves [{NAME!r}]"
    after = post(served[0], path, body)           # the server goes on serving the base model
    assert after.status_code == 200, after.text
    assert after.json()["model"] == NAME
