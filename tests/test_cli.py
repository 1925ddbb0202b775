"""The tq-chunked command: help, argument errors, the bench's modes, output and results
files, the demo."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TRITON_OK

from tq_chunked.tools import bench, bench_engine, cli, demo, testing

ROOT = Path(__file__).resolve().parent.parent


def run_main(argv, capsys):
    """(exit code, stdout, stderr) of ``tq-chunked ARGV``; an exit with a message
    (SystemExit("...")) is status 1 with that message on stderr, as Python gives it."""
    message = ""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
        if isinstance(code, str):
            code, message = 1, code + "\n"
    out, err = capsys.readouterr()
    return code, out, err + message


def test_help_lists_the_commands():
    """The real command line, in a fresh interpreter: exit 0, each command with its
    description."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    r = subprocess.run(
        [sys.executable, "-m", "tq_chunked.tools.cli", "--help"],
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


@pytest.mark.parametrize("name", list(testing.SHAPES))
def test_bench_shape_names_are_explained(name):
    """Every shape in --help and in docs/benchmarks.md's table, with its heads."""
    text = bench.make_parser().format_help()
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    (hq, hk, d), note = testing.SHAPES[name], testing.SHAPE_NOTES[name]
    line = rf"^\s+{re.escape(name)}\s+{re.escape(note)}: Hq {hq}, Hk {hk}, D {d}$"
    assert re.search(line, text, re.M), name
    assert f"| `{name}` | {note} | {hq} | {hk} | {d} |" in doc, name


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
        == "| preset | shape | q_len | cached | method | time ms | workspace MiB | "
        "ratio |"
    )
    assert "matmul ceiling measured" not in md and "0 TFLOP/s" not in md
    rows = json.loads((out_dir / f"{stem}.json").read_text())["rows"]
    assert [r["method"] for r in rows] == [
        "full",
        "chunked-torch",
        "chunked-torch-w128",
    ]
    assert all(r["error"] is None and r["time_ms"] > 0 for r in rows), rows
    assert md.count("| 70b-tp8 | 32 | 256 | ") == 3  # under 1K: tokens, not 0K
    out = capsys.readouterr().out
    assert "results into tq-chunked-results" in out
    written = [f"{bench.DEFAULT_OUT}/{stem}{x}" for x in (".json", ".md", "-time.png")]
    assert out.rstrip().endswith("\nwrote " + ", ".join(written)), out[-300:]


def test_demo_runs_several_windows_on_the_cpu_by_default():
    defaults = demo.make_parser(cuda=False).parse_args([])
    window = demo.demo_window(
        defaults.cached_len, defaults.heads[1], defaults.head_dim, torch.device("cpu")
    )
    assert (
        window == 1024 and defaults.cached_len == 4096
    )  # README: "4096 cached tokens in 5 windows"
    assert window % demo.BLOCK_SIZE == 0


def test_tiny_demo_prints_windows_times_memory_and_accuracy(capsys):
    code = demo.main(
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
    assert code == 0, out
    # 4 parts, the last
    assert "over 256 cached + 32 new tokens, in 5 windows of up to 64 keys" in out, out
    for path in ("chunked", "full-buffer"):  # median, then min–max of the repeats
        assert re.search(rf"^{path} +\d+\.\d +\d+\.\d–\d+\.\d ", out, re.M), out
    cuda = torch.cuda.is_available()
    memory = ("peak", "peak") if cuda else ("workspace", "K/V buffers")
    assert re.search(rf"^chunked .* {memory[0]} \d+\.\d MiB", out, re.M), out
    assert re.search(rf"^full-buffer .* {memory[1]} \d+\.\d MiB", out, re.M), out
    diff = float(re.search(r"\|chunked - full\| / \|full\| = (\S+) ", out).group(1))
    assert diff < 1e-2
    assert "expected: about fp16's rounding" in out
    bound = re.search(
        r"chunked (\S+), full-buffer (\S+)\. Bound \(the tests'\): chunked <= 1\.1 x "
        r"full-buffer \+ 1e-04 = (\S+): passed\.$",
        out,
        re.M,
    )
    assert bound, out
    e_chunked, e_full, limit = (float(x) for x in bound.groups())
    assert e_chunked <= limit and limit == pytest.approx(1.1 * e_full + 1e-4, rel=1e-2)
    assert (demo.CPU_NOTE in out) != cuda


@pytest.mark.parametrize("ok", [True, False], ids=["within", "beyond"])
def test_demo_reports_the_bound_and_fails_beyond_it(ok):
    """The verdict follows the bound: chunked <= 1.1 x full + 1e-4 against the
    oracle."""
    oracle = torch.ones(4, 2, 8, dtype=torch.float64)
    full = (oracle * (1 + 1e-3)).half()
    chunked = (oracle * (1 + (1e-3 if ok else 3e-3))).half()
    lines, passed = demo.accuracy_lines(chunked, full, oracle)
    assert passed is ok
    assert lines[-1].endswith("passed." if ok else "FAILED.")


# --- bench: bad input refused before anything runs ----------------------------------

BENCH_ERROR = "tq-chunked bench: error: argument "
SERVING_NAMES = "1 hit q512 8K, 16 hits q512 2K-16K, 16 hits q256 1K-8K, 24 hits"


@pytest.fixture
def nothing_runs(tmp_path, monkeypatch):
    """In tmp_path (where the default --out would go), with every way into the
    benchmark's work failing the test."""
    monkeypatch.chdir(tmp_path)
    for name in ("run", "run_engine", "CaseData", "matmul_ceiling_tflops"):
        monkeypatch.setattr(bench, name, lambda *a, **k: pytest.fail("it ran"))
    return tmp_path


def _refused(argv, capsys, code=2):
    """The one line on stderr of a refused ``tq-chunked bench ARGV``."""
    got, out, err = run_main(["bench", *argv], capsys)
    assert got == code, (got, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not out, out
    return err[:-1]


NOT_A_NAME = "--tag: expected a part of a file name, without "
NOT_POSITIVE = "expected a positive integer, got "
NO_METHOD = "--methods: no method of this run begins with "
NO_WORKLOAD = "--workloads: no workload of this run begins with "
REFUSED = {  # id: (argv, the start of the error after "argument "); {tmp}: tmp_path
    "out-a-file": (
        ["--cpu", "--out", "{tmp}/a-file"],
        (
            "--out: {tmp}/a-file exists and is not a directory; expected a directory "
            "(created if missing)"
        ),
    ),
    "out-under-a-file": (
        ["--cpu", "--out", "{tmp}/a-file/sub"],
        "--out: cannot write into {tmp}/a-file/sub: Not a directory",
    ),
    "out-empty": (["--cpu", "--out", ""], "--out: expected a directory, got ''"),
    "tag-slash": (["--cpu", "--tag", "a/b"], NOT_A_NAME + "'/', got 'a/b'"),
    "tag-up": (["--tag", "../up"], NOT_A_NAME + "'/', got '../up'"),
    "tag-backslash": (["--tag", "a\\b"], NOT_A_NAME + "'\\\\', got 'a\\\\b'"),
    "tag-newline": (["--tag", "a\nb"], NOT_A_NAME + "'\\n', got 'a\\nb'"),
    "tag-long": (
        ["--tag", "x" * 101],
        "--tag: expected at most 100 bytes (it goes into file names), got 101",
    ),
    "layers-0": (["--layers", "0"], "--layers: " + NOT_POSITIVE + "'0'"),
    "layers-negative": (["--layers", "-2"], "--layers: " + NOT_POSITIVE + "'-2'"),
    "layers-not-int": (["--layers", "2.5"], "--layers: " + NOT_POSITIVE + "'2.5'"),
    "repeats-0": (["--repeats", "0"], "--repeats: " + NOT_POSITIVE + "'0'"),
    "repeats-negative": (["--repeats", "-1"], "--repeats: " + NOT_POSITIVE + "'-1'"),
    "methods-unknown": (
        ["--cpu", "--methods", "full,nope"],
        NO_METHOD + "'nope'; its methods: full, ",
    ),
    "methods-baseline-on-cpu": (
        ["--cpu", "--methods", "baseline"],
        NO_METHOD + "'baseline'; its methods: full, ",
    ),
    "workloads-stack": (
        ["--stack", "--workloads", "llama3-8b,q512"],
        NO_WORKLOAD + "'q512'; its workloads: llama3-8b q512 8K, ",
    ),
    "workloads-serving": (
        ["--serving", "--workloads", "16 hits,zz,yy"],
        NO_WORKLOAD + f"'zz' or 'yy'; its workloads: {SERVING_NAMES}",
    ),
    "workloads-crossover": (
        ["--crossover", "--workloads", "1 hit q9"],
        NO_WORKLOAD + "'1 hit q9'; its workloads: 1 hit q8 1K, 1 hit q8 8K, ",
    ),
    "workloads-memory-bound": (
        ["--memory-bound", "--workloads", "decode 9"],
        NO_WORKLOAD + "'decode 9'; its workloads: 64 hits q16 1K-8K, 8 hits q64-128 "
        "4K-32K, decode 64 x 1K-8K, ",
    ),
    "workloads-no-mode": (
        ["--cpu", "--workloads", "16 hits"],
        (
            "--workloads: selects among the workloads of --stack, --serving, "
            "--crossover or --memory-bound; give one of them"
        ),
    ),
}


@pytest.mark.parametrize("argv, said", list(REFUSED.values()), ids=list(REFUSED))
def test_bench_refuses_bad_input_before_it_runs(argv, said, nothing_runs, capsys):
    """One line on stderr naming the option and what was expected, status 2, nothing
    run and nothing written (the default --out is not created)."""
    tmp = nothing_runs
    (tmp / "a-file").write_text("")
    argv = [a.replace("{tmp}", str(tmp)) for a in argv]
    err = _refused(argv, capsys)
    assert err.startswith(BENCH_ERROR + said.replace("{tmp}", str(tmp))), err
    assert sorted(p.name for p in tmp.iterdir()) == ["a-file"]


def test_bench_lists_this_runs_methods_with_an_unknown_one(nothing_runs, capsys):
    err = _refused(["--cpu", "--windows", "64", "--methods", "chunk,x"], capsys)
    listed = err.split("its methods: ")[1].split(" (")[0].split(", ")
    assert listed[0] == "full" and {"chunked-torch", "chunked-torch-w64"} <= set(listed)
    assert err.endswith("(baseline and vllm-<version> run on a GPU with vLLM)")


def test_bench_refuses_an_unwritable_out_before_it_runs(
    nothing_runs, capsys, monkeypatch
):
    """A directory that cannot take a file (as root, permissions would not show it:
    the probe file's creation fails here instead)."""

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(bench.tempfile, "NamedTemporaryFile", denied)
    err = _refused(["--cpu", "--out", "results"], capsys)
    assert err == BENCH_ERROR + "--out: cannot write into results: Permission denied"


def test_bench_out_is_created_and_left_clean(nothing_runs):
    """The probe file is gone after the check; an existing directory is accepted."""
    bench.prepare_out("new/deeper")
    bench.prepare_out("new/deeper")
    assert [p.name for p in (nothing_runs / "new" / "deeper").iterdir()] == []


@pytest.mark.parametrize(
    "argv, listed",
    [
        (["--stack", "--methods", "tq_chunked,nope"], "'nope'"),
        (["--serving", "--methods", "full"], "'full'"),
    ],
    ids=["unknown", "a grid method"],
)
def test_bench_engine_methods_are_checked_before_it_runs(
    argv, listed, tmp_path, capsys, monkeypatch
):
    """An engine mode's methods depend on the machine: checked once they are known,
    before any workload is built or --out created (a CUDA GPU with vLLM, faked
    here)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    baseline = argparse.Namespace(describe=lambda: "vLLM x")
    monkeypatch.setattr(bench, "load_baseline", lambda args, prog: baseline)
    names = ["baseline", "floor", "tq_chunked", "tq_chunked-default", "vllm-0.0"]
    monkeypatch.setattr(
        bench_engine,
        "methods_available",
        lambda b, mode: dict.fromkeys(names + ["patched"]),
    )
    monkeypatch.setattr(bench_engine, "run_workloads", lambda *a, **k: pytest.fail())
    err = _refused(argv, capsys)
    assert err == (
        f"{BENCH_ERROR}--methods: no method of this run begins with {listed}; its "
        f"methods: {', '.join(names)}, patched"
    )
    assert not list(tmp_path.iterdir())


EXTRA = (
    "tq-chunked bench: error: the benchmarks need the bench extra ({} is not "
    'installed): pip install "tq-chunked[bench]", or pip install -e ".[bench]" in a '
    "checkout"
)


@pytest.mark.parametrize("module", bench.BENCH_EXTRA)
@pytest.mark.parametrize(
    "argv",
    [["--cpu"], ["--stack"], ["--render", "result.json"]],
    ids=["grid", "engine", "render"],
)
def test_bench_without_its_extra_says_which_to_install(
    module, argv, nothing_runs, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, module, None)  # import module: ImportError
    monkeypatch.setattr(bench, "render", lambda *a: pytest.fail("it rendered"))
    assert _refused(argv, capsys, code=1) == EXTRA.format(module)
    assert not list(nothing_runs.iterdir())


def test_bench_without_its_extra_from_the_command_line(tmp_path):
    """In a fresh interpreter where neither module of the extra imports: the command
    and the bench module import, and it says which extra to install."""
    script = (
        "import sys; sys.modules.update(tqdm=None, matplotlib=None); "
        "from tq_chunked.tools.cli import main; sys.exit(main(['bench', '--cpu']))"
    )
    r = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
    )
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == EXTRA.format("tqdm") + "\n"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "cached_len, cell",
    [(16, "16"), (512, "512"), (1024, "1K"), (1536, "1536"), (131072, "128K")],
)
def test_the_table_shows_cached_lengths_under_1k_as_tokens(cached_len, cell):
    row = bench.Row("full", "turboquant_3bit_nc", "70b-tp8", 32, cached_len, 1.0)
    result = {
        "device": "cpu",
        "date": "2026-01-02",
        "matmul_ceiling_tflops": None,
        "baseline": "full",
        "rows": [dataclasses.asdict(row)],
    }
    line = bench.markdown(result).splitlines()[-1]
    assert line.startswith(f"| turboquant_3bit_nc | 70b-tp8 | 32 | {cell} | full |")


# --- --render and results files --------------------------------------------------

RESULTS = ROOT / "benchmarks" / "results"


def _bench_result_files():
    """The committed results JSON written by tq-chunked bench (of every version), and
    the others (vllm_forward.py's, fill_bandwidth.py's, paged_probe.py's: the last
    has rows and a device too, but no date)."""
    ours, others = [], []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        mine = isinstance(data, dict) and {"rows", "device", "date"} <= data.keys()
        (ours if mine else others).append(path.name)
    return ours, others


BENCH_FILES, OTHER_FILES = _bench_result_files()


def _not_ours(name):
    """What --render says of another tool's results file: a list (spread_probe.py's
    rows) or an object without a bench result's keys."""
    data = json.loads((RESULTS / name).read_text())
    return "{path} holds a JSON list" if isinstance(data, list) else "{path} has no "


INT32 = "--cached-len: cached + new tokens must be at most 2147483647 (int32 sequence"
MEMORY = "--cached-len: 100000000 cached + 256 new tokens at Hq"


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--cached-len", "2147483647"], (INT32, "got 2147483647 + 256")),
        (["--cached-len", "99999999999"], (INT32, "got 99999999999 + 256")),
        (["--cached-len", "100000000"], (MEMORY, "8, Hk 2, D 128 need about 4578.1")),
        (["--q-len", "4000000"], ("need about",)),
        (["--heads", "4096,2048"], ("Hq 4096, Hk 2048",)),
    ],
    ids=["int32", "beyond-int64-words", "memory", "q-len", "heads"],
)
def test_demo_sizes_beyond_this_machine_are_refused_before_anything_runs(
    argv, said, capsys, monkeypatch
):
    """One line naming the option and the limit, exit status 2, before the cache is
    built (here: 16 GiB available)."""
    monkeypatch.setattr(demo.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(demo, "available_bytes", lambda device: 16 << 30)
    monkeypatch.setattr(demo, "build_case", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("tq-chunked demo: error: argument "), err
    assert all(part in err for part in said), err


def test_the_demo_memory_estimate_holds_the_defaults_and_what_it_says_fits():
    """The default CPU demo (measured 586 MiB) is within the estimate, and the largest
    context the refusal says fits is accepted."""
    assert 586 << 20 < demo.demo_bytes(4096, 256, 8, 2, 128) < 1 << 30
    assert demo.size_error(4096, 256, 8, 2, 128, None) is None
    error = demo.size_error(10**6, 256, 8, 2, 128, 8 << 30)
    fits = int(error.rsplit("at most about ", 1)[1].split()[0])
    assert demo.size_error(fits, 256, 8, 2, 128, 8 << 30) is None
    assert demo.size_error(fits + 64, 256, 8, 2, 128, 8 << 30) is not None


@pytest.mark.parametrize("name", BENCH_FILES)
def test_every_committed_bench_result_renders(name, tmp_path, capsys):
    """Results written by earlier versions (their baseline named latest or vllm-latest)
    render with the current --render."""
    path = tmp_path / name
    path.write_text((RESULTS / name).read_text())
    before = path.read_bytes()
    code, out, err = run_main(["bench", "--render", str(path)], capsys)
    assert code in (None, 0), err
    # It says what it wrote, and the result file is only read.
    stem = str(path.with_suffix(""))
    pngs = sorted(str(p) for p in tmp_path.glob("*.png"))
    wrote = re.search(r"^wrote (.*) from (.*), which is left as it is$", out, re.M)
    assert wrote and wrote.group(2) == str(path), out[-300:]
    written = wrote.group(1).split(", ")
    assert written[0] == f"{stem}.md" and sorted(written[1:]) == pngs, out[-300:]
    assert path.read_bytes() == before
    md = path.with_suffix(".md").read_text()
    result = json.loads(path.read_text())
    assert md.startswith(("# Continuation prefill on ", f"# {result.get('mode')}: "))
    base = result.get("baseline") or bench_engine.baseline_name(result)
    assert f"{base}" in md.splitlines()[2]
    assert list(tmp_path.glob("*.png")), "no plot written"


def test_the_memory_bound_grid_covers_what_it_says():
    """testing.memory_bound_workloads (tq-chunked bench --memory-bound): B 8-256, q
    1-128 over 1K-64K cached, every head shape and preset, fp16 and bf16, decode
    batches among them, names unique."""
    from tq_chunked import PRESETS
    from tq_chunked.tools.testing import SHAPES, memory_bound_workloads

    ws = memory_bound_workloads()
    assert len({w.name for w in ws}) == len(ws)
    assert {w.shape for w in ws} == set(SHAPES)
    assert {w.preset for w in ws} == set(PRESETS)
    assert {w.dtype for w in ws} == {"float16", "bfloat16"}
    assert min(len(w.requests) for w in ws) == 8
    assert max(len(w.requests) for w in ws) == 256
    q = [q for w in ws for _, q in w.requests]
    cached = [c for w in ws for c, _ in w.requests]
    assert min(q) == 1 and max(q) == 128
    assert min(cached) >= 1024 and max(cached) == 64 * 1024
    assert sum(all(q == 1 for _, q in w.requests) for w in ws) >= 5  # decodes


def test_a_memory_bound_result_renders_its_bytes_rates_and_failures(tmp_path, capsys):
    """--memory-bound's table: each workload's quantized and fp16 bytes over 4.3 TB/s,
    and the rate each method's kernel time reads its bytes at (the floor fp16 K/V); a
    method that failed, with its error and no times."""
    row = dict(
        workload="decode 2 x 1K", shape="llama3-8b", preset="turboquant_3bit_nc",
        dtype="float16", requests=2, q_tokens=2, cached_tokens=2048,
        quantized_bytes=430_000_000, fp16_bytes=2_150_000_000, stack_ms=1.0,
        host_ms_per_call=0.01, gpu_ms_per_call=0.1, kernel_ms_per_call=0.5,
        step_ms=None, ratio=None, kernel_to_floor=None, step_to_floor=None,
    )  # fmt: skip
    result = dict(
        mode="memory-bound", device="x", date="d", layers=2, repeats=1,
        baseline="baseline",
        rows=[dict(row, method="floor"), dict(row, method="tq_chunked-paged"),
              dict(row, method="vllm-decode", error="OutOfResources: shared memory",
                   stack_ms=None, host_ms_per_call=None, gpu_ms_per_call=None,
                   kernel_ms_per_call=None)],
    )  # fmt: skip
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    code, out, err = run_main(["bench", "--render", str(path)], capsys)
    assert code in (None, 0), err
    md = (tmp_path / "r.md").read_text()
    assert md.startswith("# memory-bound: ")
    # 430 MB over 4.3 TB/s: 0.100 ms; 2150 MB: 0.500 ms; read in 0.5 ms: 0.86 and 4.30
    head = "| quantized MB | ms at copy rate | fp16 MB | ms at copy rate | floor | "
    assert head + "tq_chunked-paged | vllm-decode |" in md
    sizes = "| decode 2 x 1K | llama3-8b | float16 | 3bit_nc | 430.0 | 0.100 | 2150.0 |"
    assert f"{sizes} 0.500 | 4.30 | 0.86 |  |" in md
    failed = "- decode 2 x 1K (llama3-8b), vllm-decode: OutOfResources: shared memory"
    assert failed in md
    assert "vllm-decode (0 workloads)" in out and "floor (1 workloads)" in out


def test_the_engine_layers_copy_their_cache_up_to_the_byte_cap(monkeypatch):
    """Layers (bench_engine): a cache copy per layer while MAX_CACHE_BYTES allows, then
    the copies in turn; the workload's quantized and fp16 bytes. The batch built by
    this project's encoder (vLLM's store kernel runs on a GPU only)."""
    from tq_chunked.tools.testing import Workload

    w = Workload("d", "70b-tp8", [(64, 1), (100, 1), (48, 1)])
    one = bench_engine.Layers(w, 1, None, torch.device("cpu")).caches[0].nbytes
    monkeypatch.setattr(bench_engine, "MAX_CACHE_BYTES", 2 * one)
    layers = bench_engine.Layers(w, 5, None, torch.device("cpu"))
    c = layers.caches
    assert len(c) == 5 and c[0] is c[2] is c[4] and c[1] is c[3] and c[0] is not c[1]
    assert torch.equal(c[0], c[1])
    assert layers.quantized_bytes == (64 + 100 + 48) * 1 * c[0].shape[-1]  # Hk 1
    assert layers.fp16_bytes == (65 + 101 + 49) * 1 * 128 * 2 * 2


@pytest.mark.parametrize(
    "path",
    [
        "auto",
        pytest.param(
            "paged", marks=pytest.mark.skipif(not TRITON_OK, reason="needs Triton")
        ),
    ],
)
def test_the_bench_plans_once_a_step_and_runs_each_layer(monkeypatch, path):
    """bench_engine.method_tq_chunked runs as the plugin does: one plan a step (in
    layer 0's call) and a run per layer, each layer's answer the one
    continuation_prefill_varlen gives for it (the same bits)."""
    from tq_chunked import ContinuationPrefill, continuation_prefill_varlen
    from tq_chunked.tools.testing import Workload

    w = Workload("h", "70b-tp8", [(40, 3), (70, 1)], "turboquant_k3v4_nc")
    layers = bench_engine.Layers(w, 3, None, torch.device("cpu"))
    plans = []
    real = ContinuationPrefill.plan

    def plan(self, *args, **kwargs):
        plans.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ContinuationPrefill, "plan", plan)
    calls = bench_engine.method_tq_chunked(layers, path=path)
    for _ in range(2):  # two steps
        outs = [f() for f in calls]
    assert len(plans) == 2
    for i, out in enumerate(outs):
        q, k, v = layers.qkv[i]
        want = continuation_prefill_varlen(
            q, k, v, layers.caches[i], layers.block_table, layers.qsl_dev,
            layers.seq_lens_dev, **layers.kwargs, query_start_loc_cpu=layers.qsl_cpu,
            seq_lens_cpu=layers.seq_lens_cpu, path=path,
        )  # fmt: skip
        assert torch.equal(out, want), i


def test_a_method_applies_where_vllm_would_run_it():
    """A batch of one query token per request is one vLLM decodes: its decode kernel
    applies there alone, the baseline (a continuation prefill's method) elsewhere."""
    from tq_chunked.tools.testing import Workload

    decode = Workload("d", "llama3-8b", [(1024, 1), (2048, 1)])
    hits = Workload("h", "llama3-8b", [(1024, 1), (2048, 2)])
    baseline = bench_engine.method_baseline(None)
    assert bench_engine.method_vllm_decode.applies(decode)
    assert not bench_engine.method_vllm_decode.applies(hits)
    assert not baseline.applies(decode) and baseline.applies(hits)
    assert not hasattr(bench_engine.method_tq_chunked, "applies")


@pytest.mark.parametrize(
    "content, reason",
    [
        (None, "cannot read {path}: No such file or directory"),
        ("{oops", "{path} is not JSON (line 1, column 2: "),
        ("[1, 2]", "{path} holds a JSON list; expected a result of tq-chunked bench"),
        (
            '{"rows": []}',
            "{path} has no device, date, matmul_ceiling_tflops, baseline;",
        ),
        (
            (
                '{"mode": "stack", "device": "x", "date": "d", "layers": 1, '
                '"repeats": 1, "rows": [{"workload": "w"}]}'
            ),
            "{path}: row 0 has no shape, preset, requests",
        ),
    ]
    + [((RESULTS / name).read_text(), _not_ours(name)) for name in OTHER_FILES],
    ids=["missing", "not json", "a list", "no keys", "row keys"] + OTHER_FILES,
)
def test_render_of_a_file_it_cannot_read_is_one_line(content, reason, tmp_path, capsys):
    path = tmp_path / "result.json"
    if content is not None:
        path.write_text(content)
    code, out, err = run_main(["bench", "--render", str(path)], capsys)
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("tq-chunked bench: error: argument --render: ")
    assert reason.format(path=path) in err, err


@pytest.mark.parametrize("name", ["result.md", "result.png", "RESULT.MD"])
def test_render_never_writes_over_the_file_it_reads(name, tmp_path, capsys):
    """A result saved as X.md would be overwritten by its own table (X.md)."""
    path = tmp_path / name
    path.write_text((RESULTS / BENCH_FILES[0]).read_text())
    code, _, err = run_main(["bench", "--render", str(path)], capsys)
    assert code == 1
    assert err == (
        f"tq-chunked bench: error: argument --render: {path} would be overwritten by "
        "its own table or plot; expected the result's .json\n"
    )
    assert path.read_text() == (RESULTS / BENCH_FILES[0]).read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_render_help_says_what_it_writes():
    text = " ".join(bench.make_parser().format_help().split())
    assert "write the Markdown table and plots of a result file" in text
    assert "X.json is left as it is" in text and "rewrite" not in text


def test_render_of_a_missing_file_from_the_command_line():
    """The installed command: one line on stderr, status 1, no traceback."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tq_chunked.tools.cli",
            "bench",
            "--render",
            "missing.json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
    )
    assert r.returncode == 1
    assert r.stderr == (
        "tq-chunked bench: error: argument --render: cannot read missing.json: "
        "No such file or directory\n"
    )


# --- the baseline ---------------------------------------------------------------------


def test_bench_help_points_at_nothing_outside_the_repository():
    text = bench.make_parser().format_help()
    assert ".gpu-carry" not in text and "vllm_latest" not in text
    assert "--baseline-source PATH" in text


@pytest.mark.parametrize(
    "path",
    [
        "tq_chunked/tools/bench.py",
        "tq_chunked/tools/bench_engine.py",
        "tq_chunked/tools/baseline.py",
    ]
    + sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("benchmarks/*.py")),
)
def test_the_benchmarks_need_no_module_outside_the_repository(path):
    text = (ROOT / path).read_text()
    assert "vllm_latest" not in text and ".gpu-carry/latest" not in text


def test_bench_and_bench_engine_do_not_import_each_other_at_module_level():
    """Shapes and workloads live in tq_chunked/tools/testing.py: bench imports
    bench_engine only for the engine modes, bench_engine never imports bench."""
    import ast

    def imports(module):
        tree = ast.parse((ROOT / "tq_chunked" / "tools" / f"{module}.py").read_text())
        top = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
        every = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        return {n.module for n in top}, {n.module for n in every}

    assert "bench" not in imports("bench_engine")[1]
    assert "bench_engine" not in imports("bench")[0]


def test_a_baseline_source_on_the_cpu_is_an_error(capsys):
    code, _, err = run_main(["bench", "--cpu", "--baseline-source", "x.py"], capsys)
    assert code == 1
    assert err == (
        "tq-chunked bench: error: argument --baseline-source: vLLM's methods run on a "
        "GPU only, and this run is on the CPU\n"
    )


@pytest.mark.parametrize("source", [None, "x.py"], ids=["default", "given"])
def test_no_vllm_means_no_baseline(source):
    """--no-vllm: no vLLM methods, and a --baseline-source beside it is an error."""
    args = argparse.Namespace(cpu=False, no_vllm=True, baseline_source=source)
    if source is None:
        assert bench.load_baseline(args, "p") is None
    else:
        with pytest.raises(SystemExit, match="--no-vllm leaves vLLM's methods out"):
            bench.load_baseline(args, "p")


def test_bench_oracle_errors_hold_each_method_but_the_floor_to_float64():
    """With --oracle, the bench holds layer 0's answer of each method to the float64
    oracle, per request of 4 query tokens or more; the floor (random K/V) is not."""
    from types import SimpleNamespace

    import torch

    from tq_chunked import continuation_prefill_varlen

    requests = [(90, 20), (40, 2), (0, 12)]
    b = testing.build_batch(
        "turboquant_3bit_nc", requests, 4, 2, 64, 16, torch.float16, "cpu", seed=5
    )
    layers = SimpleNamespace(
        qkv=[(b["query"], b["key"], b["value"])],
        caches=[b["kv_cache"]],
        block_table=b["block_table"],
        qsl=b["query_start_loc"],
        seq_lens=b["seq_lens"],
        kwargs=b["kwargs"],
        hq=4,
        d=64,
    )
    out = continuation_prefill_varlen(
        b["query"],
        b["key"],
        b["value"],
        b["kv_cache"],
        b["block_table"],
        torch.tensor(b["query_start_loc"], dtype=torch.int32),
        torch.tensor(b["seq_lens"], dtype=torch.int32),
        **b["kwargs"],
        backend="torch",
    )
    wrong = out.clone()
    wrong[-12:] = 0  # the last request's answer lost
    errors = bench_engine._oracle_errors(
        layers,
        {"tq_chunked": out.float(), "wrong": wrong.reshape(len(out), -1), "floor": out},
    )
    assert set(errors) == {"tq_chunked", "wrong"}
    assert len(errors["tq_chunked"]) == 2  # the 2-token request is left out
    assert max(errors["tq_chunked"]) < 2e-3
    assert errors["wrong"][0] == errors["tq_chunked"][0] and errors["wrong"][1] == 1.0


# --- benchmarks/run_ab.py: two trees' runtimes in one process ------------------------


def test_run_ab_loads_another_runtime_beside_this_one_and_both_answer_alike(
    monkeypatch,
):
    """run_ab.py (the GPU's host A/B, NOTES.md §56) loads an earlier checkout's
    tq_chunked/runtime as another package: here this tree's, whose classes are then
    distinct from this process's and whose step answers with the same bits; a root
    without a runtime is one line naming what is missing."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    run_ab = __import__("run_ab")
    import tq_chunked.runtime as this_runtime

    other = run_ab.load_runtime(ROOT, name="run_ab_test_runtime")
    assert other.ContinuationPrefill is not this_runtime.ContinuationPrefill
    assert other.prefill.__name__ == "run_ab_test_runtime.prefill"
    heads, preset, dtype = (8, 2, 64), "turboquant_3bit_nc", torch.float16
    requests = [(40, 4), (0, 3), (70, 2)]
    b = testing.build_batch(preset, requests, *heads, 16, dtype, "cpu")
    outs = []
    for runtime in (other, this_runtime):
        plan, layer, out = run_ab.calls_of(runtime, b, heads, preset, dtype, 32, "cpu")
        layer()
        assert not out.isnan().any()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(SystemExit, match="tq_chunked/runtime/, not found"):
        run_ab.load_runtime(ROOT / "tests")


# --- benchmarks/launch_sweep.py: the cached part at chosen launches ------------------


def test_launch_sweep_reads_its_launches_and_sweeps_17_to_64_rows(monkeypatch):
    """launch_sweep.py (NOTES.md §57, §58, §62, §63): a launch is block_n/programs an
    SM/warps with an optional /p0-/p2 prefetch, /m16-/m64 tile rows, /r32-/r255
    register cap (/r0: Triton's count) and /l0 or /l1 loads first, in any order,
    anything else one line naming it; every batch it sweeps has 17-64 query rows a
    kv head (the 32- and 64-row tiles), or is a decode in a "-decode" group, at the
    head size its group names."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sweep = __import__("launch_sweep")
    assert sweep.parse_launch("64/32/2") == dict(
        block_n=64, programs_per_sm=32, num_warps=2
    )
    assert sweep.parse_launch("128/8/4/p0")["prefetch"] == 0
    assert sweep.parse_launch("64/16/2/m64/p1") == dict(
        block_n=64, programs_per_sm=16, num_warps=2, block_m=64, prefetch=1
    )
    assert sweep.parse_launch("64/12/4/r168")["max_registers"] == 168
    assert sweep.parse_launch("32/32/1/r0/p0")["max_registers"] == 0
    assert sweep.parse_launch("128/8/4/l0")["loads_first"] is False
    for bad in ("64/32", "64/32/2/p3", "64/32/2/0", "64/x/2", "0/8/4", "64/16/2/m48",
                "64/16/2/m64/m32", "64/16/2/r16", "64/16/2/r256",
                "64/16/2/r", "64/16/2/l2"):  # fmt: skip
        with pytest.raises(SystemExit, match=f"--launches: '{bad}'"):
            sweep.parse_launch(bad)
    for text in sweep.LAUNCHES.split(","):
        sweep.parse_launch(text)
    for group, batches in sweep.BATCHES.items():
        for _, shape, requests, _, _ in batches:
            hq, hk, d = testing.SHAPES[shape]
            assert group.split("-")[0] == f"d{d}"  # "d64", "d64-wide"
            rows = max(q for _, q in requests) * hq // hk
            assert rows <= 16 if group.endswith("-decode") else 17 <= rows <= 64


# --- benchmarks/ncu_lines.py: a profile's stall samples per line ----------------------


def test_ncu_lines_shares_each_stall_reason_over_the_lines(
    tmp_path, capsys, monkeypatch
):
    """ncu_lines.py (NOTES.md §62): a line's share of the samples and of each reason
    asked for is of the kernel's totals, counted over its SASS rows (a row without a
    line counts in the totals only); thousands separators and "-" read as counts."""
    head = ["Line No", "Source", "Warp Stall Sampling (All Samples)",
            "Instructions Executed", "stall_long_sb", "stall_wait"]  # fmt: skip
    rows = [
        ["File Path", "/x/paged.py"],
        head,
        ["10", "h0 = tl.load(p)", "300", "1,000", "200", "100"],
        ["11", "acc = tl.dot(a, b)", "100", "3,000", "0", "100"],
        ["", "LDG", "300", "1,000", "200", "100"],
        ["", "HMMA", "100", "3,000", "-", "100"],
        ["", "STL", "400", "4,000", "200", "-"],  # a spill: no line
    ]
    path = tmp_path / "lines.csv"
    path.write_text("\n".join(",".join(f'"{c}"' for c in r) for r in rows) + "\n")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    lines_mod = __import__("ncu_lines")
    lines, samples, inst, totals = lines_mod.per_line(path, ("long_sb", "wait"))
    assert (samples, inst) == (800, 8000)
    assert totals == {"long_sb": 400, "wait": 200}
    assert lines[("paged.py", 10)][:3] == [300, 1000, "h0 = tl.load(p)"]
    assert lines[("paged.py", 10)][3] == {"long_sb": 200, "wait": 100}
    monkeypatch.setattr(
        sys, "argv", ["ncu_lines.py", str(path), "--reasons", "long_sb"]
    )
    lines_mod.main()
    out = capsys.readouterr().out
    assert "| 37.5 % | 12.5 % | paged.py:10 | `h0 = tl.load(p)` |" in out
    assert "long_sb: 50.0 % of the stall samples" in out
    assert "| 50.0 % | paged.py:10 |" in out
    assert "paged.py:11 |" in out.split("long_sb:")[0]  # no long_sb: not listed
    assert "paged.py:11" not in out.split("long_sb:")[1]
