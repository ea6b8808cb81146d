"""What every test folder shares: the bundled model, engines over it, and the suite's Redis.

Tests are arranged by layer (tests/algorithm, tests/tiers, tests/engine, tests/service, tests/api,
tests/e2e, tests/project); pytest's ``pythonpath`` puts tests/ itself on the path, so shared helpers
(``serving_helpers``, ``service_fakes``) import by name from any folder.
"""
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Served turns sample with chat defaults; the suite's servers decode greedily (their replies are compared
# across replicas, restores and replays), and the tests of the defaults ask for them by name.
os.environ.setdefault("RKV_DEFAULT_TEMPERATURE", "0")
os.environ.setdefault("RKV_DEFAULT_REPETITION_PENALTY", "1")
# The suite serves the small bundled model (a server's own default is the larger chat model, which
# tests/e2e/test_first_chat.py loads by name).
os.environ.setdefault("RKV_MODEL", "bundled:smollm2-135m")
# Triton reads TRITON_INTERPRET when its kernels are first decorated, and any test folder may import
# them first: without a GPU, the whole run builds them for the interpreter (the kernel tests need it;
# nothing else on a CPU runs them). On a GPU machine, TRITON_INTERPRET=0 runs them on CUDA.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

REDIS_URL = os.environ.get("RKV_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
# CI starts Redis before the suite: there, a Redis that does not answer fails its tests instead of skipping them.
REDIS_REQUIRED = os.environ.get("RKV_TEST_REQUIRE_REDIS", "") == "1"


def _redis_answers(url: str) -> str | None:
    """None when Redis answers at ``url``, else why not."""
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except Exception as exc:  # any failure to reach it means the same to a test
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The suite's shared Redis (``RKV_TEST_REDIS_URL``, default 127.0.0.1:6379/0), for tests that need one.

    Unreachable, the tests that take it skip, or fail with ``RKV_TEST_REQUIRE_REDIS=1``. Each test uses
    its own key namespace and cleans up after itself; tests that stop Redis start a private one
    (``serving_helpers.RedisServer``) instead.
    """
    problem = _redis_answers(REDIS_URL)
    if problem is not None:
        message = f"needs Redis at {REDIS_URL} (RKV_TEST_REDIS_URL): {problem}"
        if REDIS_REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    return REDIS_URL


@pytest.fixture(scope="session")
def loaded():
    """The bundled model, loaded once per test run (converted once per machine)."""
    import transformers

    from app.model_loader import load_model
    from app.settings import Settings

    transformers.utils.logging.disable_progress_bar()
    return load_model(Settings())


@pytest.fixture
def make_engine(loaded):
    from app.engine.engine import Engine
    from app.settings import Settings

    engines = []

    def make(**overrides):
        engine = Engine(Settings(**overrides), loaded=loaded)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def private_redis(tmp_path):
    """A private ``redis-server`` (AOF on) for tests that stop it, or that account for every key it holds."""
    from serving_helpers import RedisServer

    with RedisServer(tmp_path) as server:
        yield server
