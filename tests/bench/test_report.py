"""``rocketkv-mt bench report``: docs/benchmarks.md is exactly what the shipped result files give now,
one section per benchmark, every run with its command, machine and commit; the result files carry
those fields themselves, and new results get them when they are written."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil

from bench import e2e, report
from bench.common import write_json
from bench.plot import plottable
from bench.provenance import command, commit
from bench.results import RESULTS, ROOT, shipped
from cli.main import build_parser

HASH = re.compile(r"^[0-9a-f]{7}(-dirty)?$")
# The RKV_ settings in force, then the command: `rocketkv-mt ...`, or a bench run as a module (the GPU check).
COMMAND = r"(RKV_\w+=\S+ )*(rocketkv-mt|python -m bench\.\w+) .+"


def sections(text: str) -> dict[str, str]:
    found = re.split(r"^## ", text, flags=re.M)[1:]
    return {s.splitlines()[0].strip(): s for s in found}


def test_docs_benchmarks_md_is_what_bench_report_writes_now():
    # Regenerate with `rocketkv-mt bench report` after changing a result file or the report.
    assert report.DOC.read_text() == report.build(shipped()), "docs/benchmarks.md is stale: run `rocketkv-mt bench report`"


def test_every_figure_the_page_links_is_there_and_every_figure_there_is_linked():
    text = report.DOC.read_text()
    linked = set(re.findall(r"!\[[^\]]*\]\(benchmarks/([^)]+\.png)\)", text))
    on_disk = {p.name for p in (report.DOC.parent / "benchmarks").glob("*.png")}
    assert linked == on_disk
    assert linked == {f"{r.name}.png" for r in shipped() if plottable(r)}


def test_one_section_per_benchmark_each_run_with_its_command_machine_and_commit():
    found = sections(report.DOC.read_text())
    folders = {p.parent.relative_to(RESULTS).parts[0] for p in RESULTS.rglob("*.json")}
    assert set(found) == folders
    for name, body in found.items():
        runs = [r for r in re.split(r"^### ", body, flags=re.M)[1:] if not r.startswith("Budget sweep")]
        files = sorted(p.relative_to(ROOT).as_posix() for p in (RESULTS / name).rglob("*.json"))
        assert sorted(run.splitlines()[0].strip("` ") for run in runs) == files, name
        for run in runs:
            assert re.search(rf"^- command: `{COMMAND}`$", run, re.M), run
            assert re.search(r"^- machine: .+, \d+ cores, (no GPU|GPU .+)$", run, re.M), run
            assert re.search(r"^- commit: [0-9a-f]{7}(-dirty)?$", run, re.M), run
            assert re.search(r"^\|---\|", run, re.M), f"{name}: a run without its table"


def test_every_shipped_result_carries_its_command_machine_and_commit():
    for result in shipped():
        data, where = result.data, result.relative()
        assert re.fullmatch(COMMAND, data["command"]), where
        if "--json" in data["command"]:  # run again, it writes this very file
            assert data["command"].endswith(f"--json {where}"), where
        assert set(data["machine"]) == {"cpu", "cores", "gpu"} and data["machine"]["cores"] >= 1, where
        assert HASH.match(data["commit"]), where


def test_report_writes_page_and_figures_twice_alike_and_drops_stale_figures(tmp_path):
    results = tmp_path / "results"
    for name in ("decode", "hsa"):
        shutil.copytree(RESULTS / name, results / name)
    doc = tmp_path / "docs" / "benchmarks.md"
    (doc.parent / "benchmarks").mkdir(parents=True)
    stale = doc.parent / "benchmarks" / "decode-gone.png"
    stale.write_bytes(b"old")
    args = build_parser().parse_args(["bench", "report", "--results", str(results), "--out", str(doc)])
    assert args.func(args) == 0
    first = doc.read_text()
    figures = {p.name: p.read_bytes() for p in (doc.parent / "benchmarks").iterdir()}
    assert not stale.exists()
    assert set(figures) == {"decode-8k_b256.png", "decode-8k_b512.png"}  # hsa has a table, no figure
    assert list(sections(first)) == ["decode", "hsa"]
    assert args.func(args) == 0
    assert doc.read_text() == first
    assert {p.name: p.read_bytes() for p in (doc.parent / "benchmarks").iterdir()} == figures


def test_a_result_of_a_benchmark_the_report_does_not_know_is_listed_by_its_fields(tmp_path):
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "summary.json").write_text(json.dumps(
        {"command": "rocketkv-mt bench e2e --json results/gpu/summary.json", "commit": "abcdef1",
         "machine": {"cpu": "Some CPU", "cores": 16, "gpu": "NVIDIA H100"}, "wall_s": 301.5,
         "parts": {"e2e": "ok", "kernel_tests": "2 failed | see\nlog"}}))
    text = report.build(shipped(tmp_path), results_dir=tmp_path)
    assert "- machine: Some CPU, 16 cores, GPU NVIDIA H100" in text
    assert "| wall_s | 301.5 |" in text and "| parts.e2e | ok |" in text
    assert "| parts.kernel_tests | 2 failed \\| see log |" in text  # one row, whatever the value holds


def test_a_written_result_is_stamped_with_its_provenance(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["/usr/bin/rocketkv-mt", "bench", "decode", "--json", "out.json"])
    for name in [k for k in os.environ if k.startswith("RKV_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("RKV_THREADS", "1")
    monkeypatch.setenv("RKV_TEST_REQUIRE_REDIS", "1")  # the suite's switch, not a setting of the bench
    write_json({"context": 10}, str(tmp_path / "out.json"), quiet=True)
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["command"] == "RKV_THREADS=1 rocketkv-mt bench decode --json out.json"
    assert data["machine"]["cores"] >= 1 and data["machine"]["cpu"]
    assert data["commit"] is None or re.match(r"^[0-9a-f]{7}(-dirty)?$", data["commit"])
    assert data["context"] == 10


def test_the_command_reads_as_typed_again():
    assert command(["/x/cli/__main__.py", "eval", "--modes", "full,tiered", "--variants", '{"a": 1}'],
                   {"RKV_MODEL": "bundled:qwen2.5-coder-0.5b", "PATH": "/bin"}) == \
        "RKV_MODEL=bundled:qwen2.5-coder-0.5b rocketkv-mt eval --modes full,tiered --variants '{\"a\": 1}'"
    assert command(["/repo/bench/gpu_check.py", "--quick"], {}) == "python -m bench.gpu_check --quick"


def test_a_tree_without_git_names_the_commit_it_travelled_with(tmp_path, monkeypatch):
    # A lent GPU machine receives the tree without .git; gpu_run.sh exports the bundle's commit.
    monkeypatch.delenv("RKV_SOURCE_COMMIT", raising=False)
    assert commit(tmp_path) is None
    monkeypatch.setenv("RKV_SOURCE_COMMIT", "0123abc")
    assert commit(tmp_path) == "0123abc"
    assert re.match(r"^[0-9a-f]{7}(-dirty)?$", commit(ROOT))  # a checkout answers for itself
    assert "RKV_SOURCE_COMMIT" not in command(["rocketkv-mt", "bench", "hsa"])


def test_an_eval_with_task_kinds_shows_correct_answers_per_kind():
    mode = {"correct": 3, "total": 8, "per_turn_accuracy": [0.5, 0.25], "peak_device_kv_bytes": 2e6,
            "mean_turn_latency_ms": 1500.0}
    d = {"tasks": "bench/tasks/ruler_6k.jsonl", "conversations": 2, "budget": 256,
         "modes": {"full": {**mode, "per_kind": {"needles": {"correct": 2, "total": 4}}},
                   "tiered": {**mode, "per_kind": {"needles": {"correct": 1, "total": 4},
                                                   "squad": {"correct": 0, "total": 4}}}}}
    lines = report._eval(d)
    assert lines[2] == "| mode | correct | accuracy per turn | needles | squad | peak device KV | mean turn latency |"
    assert lines[4].startswith("| `full` | 3 / 8 | 0.5 / 0.25 | 2 / 4 | - | 2.0 MB")
    assert lines[5].startswith("| `tiered` | 3 / 8 | 0.5 / 0.25 | 1 / 4 | 0 / 4 | 2.0 MB")


def test_the_gpu_checks_files_read_as_tables(tmp_path):
    """e2e (a real tiny run), the summary, the kernel tests and the tiered turns each get a table of
    their figures, not a dump of fields."""
    e2e_args = dict(contexts="300", batches="1,2", modes="full,rocketkv,tiered", shapes="tiny,num_hidden_layers=2",
                    device="cpu", budget=32, max_new=16, steps=1, rounds=1, warmup=0, second_turn=8, rows=4096,
                    json_out=str(tmp_path / "gpu" / "e2e.json"))
    (tmp_path / "gpu").mkdir()
    assert e2e.main(argparse.Namespace(**e2e_args)) == 0
    base = {"command": "python -m bench.gpu_check --out results/gpu", "commit": "abcdef1"}
    write_json({**base, "device": "GPU X", "torch": "2.x", "budget_s": 450.0, "wall_s": 100.0,
                "estimates_s": {"e2e": 150.0, "kernel_tests": 150.0, "h2d": 10.0},
                "parts": {"e2e": {"error": "OutOfMemoryError: " + "x" * 400, "wall_s": 75.0},
                          "kernel_tests": {"headline": "58/59 passed; FAILED ['t']", "wall_s": 20.0},
                          "h2d": {"skipped": "no time left", "wall_s": 0.0}}},
               str(tmp_path / "gpu" / "summary.json"), quiet=True)
    write_json({**base, "tests": 59, "failures": 1, "errors": 0, "skipped": 0, "passed": 58,
                "failed": ["tests.algorithm.test_kernels::test_one[a]"], "first_failure": "AssertionError: 1 != 2"},
               str(tmp_path / "gpu" / "kernel_tests.json"), quiet=True)
    turn = {"ttft_ms": 12.5, "prefilled_tokens": 600, "generated_tokens": 8, "device_bytes": 1e6, "host_bytes": 2e6,
            "redis_bytes": 3e6, "readmitted_tokens": 7, "cold_bytes_read": 4e5, "redis_bytes_written": 3e6}
    write_json({**base, "device": "cuda", "redis": "private", "model": "random", "turns": [turn, turn],
                "redis_session_bytes_after_turn_3": 3e6}, str(tmp_path / "gpu" / "tiered_redis.json"), quiet=True)
    text = report.build(shipped(tmp_path), results_dir=tmp_path)
    result = json.loads((tmp_path / "gpu" / "e2e.json").read_text())
    for mode in ("full", "rocketkv", "tiered"):
        row = next(line for line in text.splitlines() if line.startswith(f"| 300 | `{mode}` |"))
        ms = result["results"][0]["decode"]["2"][mode]["ms_per_step"]
        assert f"{ms:,.1f} ms" in row and (mode == "full") == ("x)" not in row)  # speed-up beside compressed modes
    assert "| `e2e` | **error**: OutOfMemoryError: xxx" in text and "x" * 300 not in text
    assert "| `kernel_tests` | 58/59 passed; FAILED ['t'] | 20 s | 150 s |" in text
    assert "| `h2d` | skipped: no time left |" in text
    assert "| 59 | **58** | 1 | 0 | 0 |" in text and "`test_one[a]`" in text and "AssertionError: 1 != 2" in text
    assert text.count("| 12.5 ms | 600 | 8 | 1.0 MB | 2.0 MB | 3.0 MB | 7 | 0.4 MB | 3.0 MB |") == 2
    assert "| field | value |" not in text
