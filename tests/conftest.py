"""Shared fixtures: tiny random models built by transformers, engines that are checked for leaks."""
from __future__ import annotations

import pytest

from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture
def make_llm():
    """Build LLMs that are leak-checked and shut down when the test ends."""
    from tandem import LLM
    made = []

    def make(model, **kw):
        kw.setdefault("kv_cache_tokens", 8192)
        kw.setdefault("max_running_requests", 32)
        kw.setdefault("poison_future_map", True)
        llm = LLM(model, **kw)
        made.append(llm)
        return llm

    yield make
    try:
        for llm in made:
            assert_no_leaks(llm)
    finally:
        for llm in made:
            llm.shutdown()


@pytest.fixture(scope="session")
def smollm():
    """The real default model in the exact mode (kernels_act="fp32": the parity tests' mode), loaded once
    (overlap loop; tests switch loops per run). The default int8 mode: smollm_int8."""
    from tandem import LLM
    llm = LLM(poison_future_map=True, kernels_act="fp32")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    """One engine on the tiny Llama for a module (tests switch loops per run); leak-checked at the end."""
    from tandem import LLM
    llm = LLM(tiny_llama, kv_cache_tokens=4096, max_running_requests=16, poison_future_map=True)
    yield llm
    assert_no_leaks(llm)
    llm.shutdown()


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    """`tandem serve` on the tiny Llama for a module, served as "tiny"; it must exit 0 at the end."""
    from tests.helpers.server_utils import ServerProcess
    srv = ServerProcess(["--model", tiny_llama, "--kv-cache-tokens", "8192", "--device-threads", "1",
                         "--served-model-name", "tiny"], str(tmp_path_factory.mktemp("log") / "server.log"))
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on that server."""
    c = server.openai_client(timeout=60)
    yield c
    c.close()
