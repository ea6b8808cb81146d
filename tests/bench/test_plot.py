"""``rocketkv-mt bench plot`` on the shipped result files: every kind of result it draws comes out as
a real picture, and a result it cannot draw is refused without writing anything."""
from __future__ import annotations

import shutil

import pytest

from bench.plot import plottable
from bench.results import shipped
from cli.main import build_parser

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_cli(*argv: str) -> int:
    args = build_parser().parse_args(["bench", *argv])
    return args.func(args)


def assert_picture(path) -> None:
    """A PNG of a drawn figure: the signature, a decodable image of a figure's size, and not one colour."""
    import matplotlib.image

    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert height >= 200 and width >= 300, (path, image.shape)
    assert image[..., :3].std() > 0.05, f"{path} is blank"


def test_every_plottable_shipped_result_is_drawn(tmp_path):
    results = [r for r in shipped() if plottable(r)]
    # The benchmarks the figures are for, each with at least one shipped file to draw.
    assert {r.bench for r in results} >= {"eval", "decode", "scaling", "capacity", "serve", "stall"}
    assert run_cli("plot", *(str(r.path) for r in results), "--out", str(tmp_path / "figures")) == 0
    drawn = sorted((tmp_path / "figures").iterdir())
    assert [p.name for p in drawn] == sorted(f"{r.name}.png" for r in results)
    for path in drawn:
        assert_picture(path)


def test_the_same_result_draws_the_same_bytes(tmp_path):
    (result,) = [r for r in shipped() if r.name == "scaling-b256"]
    for out in ("a", "b"):
        assert run_cli("plot", str(result.path), "--out", str(tmp_path / out)) == 0
    assert (tmp_path / "a" / "scaling-b256.png").read_bytes() == (tmp_path / "b" / "scaling-b256.png").read_bytes()


def test_a_result_without_a_figure_is_refused_and_nothing_is_written(tmp_path, capsys):
    (hsa,) = [r for r in shipped() if r.name == "hsa-step"]
    (decode,) = [r for r in shipped() if r.name == "decode-8k_b256"]
    assert not plottable(hsa)
    assert run_cli("plot", str(decode.path), str(hsa.path), "--out", str(tmp_path / "figures")) == 2
    assert "no figure for a hsa result" in capsys.readouterr().err
    assert not (tmp_path / "figures").exists()


def test_two_files_that_would_draw_one_figure_are_refused(tmp_path, capsys):
    (decode,) = [r for r in shipped() if r.name == "decode-8k_b256"]
    copy = tmp_path / "elsewhere" / "decode" / "8k_b256.json"
    copy.parent.mkdir(parents=True)
    shutil.copy(decode.path, copy)
    assert run_cli("plot", str(decode.path), str(copy), "--out", str(tmp_path / "figures")) == 2
    assert "decode-8k_b256" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["serve-16x3", "serve-stall_8"])
def test_load_and_stall_runs_of_bench_serve_get_their_own_figures(name, tmp_path):
    (result,) = [r for r in shipped() if r.name == name]
    assert run_cli("plot", str(result.path), "--out", str(tmp_path)) == 0
    assert_picture(tmp_path / f"{name}.png")
