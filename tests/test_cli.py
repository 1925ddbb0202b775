"""The tq-chunked command: help, argument errors, the bench's modes and output, the demo."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tq_chunked import bench, cli, demo

ROOT = Path(__file__).resolve().parent.parent


def run_main(argv, capsys):
    """(exit code, stdout, stderr) of ``tq-chunked ARGV``."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_commands():
    """The real command line, in a fresh interpreter: exit 0, each command with its description."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    r = subprocess.run(
        [sys.executable, "-m", "tq_chunked.cli", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: tq-chunked ")
    for name, description in cli.COMMANDS.items():
        assert re.search(
            rf"^\s+{name}\s+{re.escape(description.split()[0])}", r.stdout, re.M
        ), r.stdout


def test_no_arguments_lists_the_commands(capsys):
    code, out, _ = run_main([], capsys)
    assert code == 2
    assert "usage: tq-chunked" in out and all(
        re.search(rf"^\s+{name}\s", out, re.M) for name in cli.COMMANDS
    )


def test_unknown_command_is_an_argparse_error(capsys):
    code, _, err = run_main(["--heads", "8"], capsys)
    assert code == 2
    assert "tq-chunked: error:" in err and "'--heads'" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_command_help_names_itself(command, capsys):
    code, out, _ = run_main([command, "--help"], capsys)
    assert code == 0
    assert out.startswith(f"usage: tq-chunked {command} ")


@pytest.mark.parametrize("module", [demo, bench], ids=["demo", "bench"])
def test_every_option_has_help_text(module):
    parser = module.make_parser()
    missing = [
        a.option_strings
        for a in parser._actions
        if not a.help or a.help == argparse.SUPPRESS
    ]
    assert not missing
    assert (
        "``" not in parser.format_help()
    )  # reStructuredText quoting is for docstrings, not --help


@pytest.mark.parametrize(
    "argv, option",
    [
        (["demo", "--heads", "8"], "--heads"),
        (["demo", "--heads", "8,3"], "--heads"),
        (["demo", "--window", "100"], "--window"),
        (["demo", "--head-dim", "96"], "--head-dim"),
        (["demo", "--preset", "turboquant_5bit"], "--preset"),
        (["demo", "--cached-len", "4k"], "--cached-len"),
        (["bench", "--q-lens", "2k"], "--q-lens"),
        (["bench", "--cached-lens", "1024,x"], "--cached-lens"),
        (["bench", "--shapes", "70b"], "--shapes"),
        (["bench", "--presets", "turboquant_5bit"], "--presets"),
        (["bench", "--windows", "100"], "--windows"),
        (["bench", "--cpu", "--memory-lens", "1024"], "--memory-lens"),
    ],
)
def test_bad_arguments_are_argparse_errors(argv, option, capsys):
    code, _, err = run_main(argv, capsys)
    assert code == 2
    assert f"tq-chunked {argv[0]}: error: argument {option}" in err, err
    assert "Traceback" not in err


def test_bench_shape_names_are_explained():
    """Every shape in --help and in docs/benchmarks.md's table, with its heads."""
    text = bench.make_parser().format_help()
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    for name, (hq, hk, d) in bench.SHAPES.items():
        assert re.search(
            rf"^\s+{re.escape(name)}\s+{re.escape(bench.SHAPE_NOTES[name])}: Hq {hq}, Hk {hk}, "
            rf"D {d}$",
            text,
            re.M,
        ), name
        assert f"| `{name}` | {bench.SHAPE_NOTES[name]} | {hq} | {hk} | {d} |" in doc, (
            name
        )


def test_cpu_mode_keeps_explicit_options():
    a = bench.parse(
        [
            "--cpu",
            "--cached-lens",
            "512",
            "--shapes",
            "llama3-8b",
            "--windows",
            "",
            "--presets",
            "turboquant_k8v4,turboquant_4bit_nc",
        ]
    )
    assert a.mode == "cpu"
    assert a.cached_lens == [512] and a.shapes == ["llama3-8b"] and a.windows == []
    assert a.presets == ["turboquant_k8v4", "turboquant_4bit_nc"]
    assert a.q_lens == bench.SIZES["cpu"]["q_lens"]  # not given: the CPU default
    assert a.memory_lens == []


def test_quick_on_the_cpu_is_the_cpu_mode_with_its_file_names():
    result = {"device": "cpu", "date": "2026-01-02"}
    quick, cpu = bench.parse(["--quick", "--cpu"]), bench.parse(["--cpu"])
    assert quick.mode == cpu.mode == "cpu"
    assert quick.cached_lens == cpu.cached_lens
    assert (
        bench.output_stem(result, quick)
        == bench.output_stem(result, cpu)
        == "cpu-2026-01-02"
    )
    gpu_quick = argparse.Namespace(mode="quick", tag="t")
    assert (
        bench.output_stem({"device": "NVIDIA H200", "date": "2026-01-02"}, gpu_quick)
        == "nvidia-h200-2026-01-02-quick-t"
    )


def test_default_output_directory_is_outside_the_committed_results():
    out = Path(bench.parse([]).out)
    assert not out.is_absolute()  # relative to where the user runs it
    assert out.parts[0] != "benchmarks" and (ROOT / out).resolve() != (
        ROOT / "benchmarks" / "results"
    )
    assert f"{out.as_posix()}/" in (ROOT / ".gitignore").read_text().splitlines()
    assert bench.parse(["--out", "elsewhere"]).out == "elsewhere"


def test_tiny_cpu_bench_writes_into_the_default_directory(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    committed = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    bench.main(
        [
            "--cpu",
            "--presets",
            "turboquant_3bit_nc",
            "--shapes",
            "70b-tp8",
            "--cached-lens",
            "256",
            "--q-lens",
            "32",
            "--windows",
            "128",
            "--methods",
            "full,chunked-torch",
            "--no-vllm",
        ]
    )
    out_dir = tmp_path / bench.DEFAULT_OUT
    (md_path,) = out_dir.glob("cpu-*.md")
    stem = md_path.name[:-3]
    assert (out_dir / f"{stem}.json").is_file() and (
        out_dir / f"{stem}-time.png"
    ).is_file()
    assert (
        sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir()) == committed
    )

    md = md_path.read_text()
    header = next(line for line in md.splitlines() if line.startswith("| preset"))
    assert (
        header
        == "| preset | shape | q_len | cached | method | time ms | workspace MiB | ratio |"
    )
    assert "matmul ceiling measured" not in md and "0 TFLOP/s" not in md
    rows = json.loads((out_dir / f"{stem}.json").read_text())["rows"]
    assert [r["method"] for r in rows] == [
        "full",
        "chunked-torch",
        "chunked-torch-w128",
    ]
    assert all(r["error"] is None and r["time_ms"] > 0 for r in rows), rows
    assert "results into tq-chunked-results" in capsys.readouterr().out


def test_demo_runs_several_windows_on_the_cpu_by_default():
    defaults = demo.make_parser(cuda=False).parse_args([])
    window = demo.demo_window(
        defaults.cached_len, defaults.heads[1], defaults.head_dim, torch.device("cpu")
    )
    assert (
        window == 1024 and defaults.cached_len == 4096
    )  # README: "4096 cached tokens in 5 windows"
    assert window % demo.BLOCK_SIZE == 0


def test_tiny_demo_prints_windows_times_memory_and_difference(capsys):
    demo.main(
        [
            "--cached-len",
            "256",
            "--q-len",
            "32",
            "--heads",
            "2,1",
            "--head-dim",
            "64",
            "--window",
            "64",
            "--repeats",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert "over 256 cached + 32 new tokens, in 5 windows of up to 64 keys" in out, (
        out
    )  # 4 parts, the last
    for path in ("chunked", "full-buffer"):  # median, then min–max of the repeats
        assert re.search(rf"^{path} +\d+\.\d +\d+\.\d–\d+\.\d ", out, re.M), out
    memory = (
        ("peak", "peak") if torch.cuda.is_available() else ("workspace", "K/V buffers")
    )
    assert re.search(rf"^chunked .* {memory[0]} \d+\.\d MiB", out, re.M), out
    assert re.search(rf"^full-buffer .* {memory[1]} \d+\.\d MiB", out, re.M), out
    diff = float(re.search(r"\|chunked - full\| / \|full\| = (\S+)", out).group(1))
    assert diff < 1e-2
