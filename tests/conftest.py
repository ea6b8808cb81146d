import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
