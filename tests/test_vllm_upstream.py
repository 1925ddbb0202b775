"""vLLM's own TurboQuant tests, and vLLM's lint, on the change as vLLM would merge it.

For each ``.vllm-envs/vllm-<version>/`` whose ``src/`` holds that release's tests and
pyproject.toml (``bash tests/install_vllm_cpu.sh`` takes them from the release's source
distribution), in that environment's Python, on a CPU (Triton's interpreter;
``vllm_harness.cpu_test_env``):

* vLLM's TurboQuant tests: ``tests/quantization/test_turboquant.py``,
  ``tests/kernels/turboquant/`` and ``tests/kernels/ultraquant/`` where the release has
  them, and the TurboQuant cases of
  ``tests/v1/attention/test_rocm_attention_backends_selection.py`` (pytest
  ``-k "turboquant or ultraquant"``), run
  - ``unmodified``: on the release as it is (the plugin off): none fails;
  - ``vendored``: on a tree ``python -m tq_chunked.vendor`` has written into, with the
    tests as the change leaves them (the reservation tests rewritten, its own test
    added): none fails, and every case of the added test runs;
  - ``vendored-as-released``: on the same tree with the release's tests as they are:
    exactly the tests the change rewrites fail (they assert the (1, Hk, max_model_len,
    D) pair the change replaces);
  - ``plugin``: on the release with the plugin loaded as vLLM's processes load it
    (``vllm.plugins.load_general_plugins()``, entry point group
    ``vllm.general_plugins``), before the tests: exactly those tests fail, for the same
    reason.
  The counts are printed (``-s``), one line per release and mode.
* vLLM's lint of the vendored tree: ``ruff check`` and ``ruff format --check`` (ruff
  0.17.2, this project's pin, vLLM 0.34.0's) with the release's pyproject.toml, at the
  root of the tree as in a checkout: the vendored package and the added test have no
  finding; the edited ``turboquant_attn.py`` and ``test_turboquant.py``, none that
  vLLM's own files do not have.
* vLLM's pre-commit, for the release whose ``pre-commit/`` the install script fetched
  (the newest it built): every hook of its .pre-commit-config.yaml that checks Python
  and selects a file the vendor tool writes, run from the release's own files and at
  its pins, offline (``test_the_vendored_change_passes_vllms_pre_commit``).

vLLM's tests that need a GPU skip here (``benchmarks/vllm_tests_gpu.sh`` runs them on
the H200 machine).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tq_chunked.tools.vllm_harness import cpu_test_env, symlink_farm, vllm_envs
from tq_chunked.vendor import CI_JOBS, NEW_TEST, VENDORED_DIR, VLLM_TEST

ROOT = Path(__file__).resolve().parent.parent
HAS_VLLM = importlib.util.find_spec("vllm") is not None
ENVS = {name: Path(python) for name, python in vllm_envs(ROOT).items()}
SELECT = "turboquant or ultraquant"
RUFF = "0.17.2"  # this project's pin: vLLM 0.34.0's .pre-commit-config.yaml
RESERVATION = ROOT / "tq_chunked" / "upstream_tests" / "turboquant_reservation.py"
TARGET = Path("vllm/v1/attention/backends/turboquant_attn.py")

pytestmark = pytest.mark.skipif(
    HAS_VLLM, reason="runs from an environment without vLLM, in each .vllm-envs/ one"
)


@dataclass
class Outcome:
    passed: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    skipped: set[str] = field(default_factory=set)
    log: str = ""

    def line(self) -> str:
        return (
            f"{len(self.passed)} passed / {len(self.failed)} failed / "
            f"{len(self.skipped)} skipped"
        )


def _junit(path: Path) -> Outcome:
    out = Outcome()
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            out.failed.add(name)
        elif case.find("skipped") is not None:
            out.skipped.add(name)
        else:
            out.passed.add(name)
    return out


def run_vllm_tests(python, cwd: Path, env, load_plugins=False) -> Outcome:
    """The TurboQuant ones of vLLM's tests under ``cwd/tests`` (its pyproject.toml in
    ``cwd``), in a fresh process of ``python``; with ``load_plugins``, vLLM's general
    plugins are loaded in it first, as vLLM's processes do."""
    report = cwd / "junit.xml"
    args = ["-q", "-p", "no:cacheprovider", "-k", SELECT, f"--junitxml={report}"]
    args.append("tests")
    code = (
        "import sys, pytest\n"
        + (
            "import vllm.plugins\n"
            "vllm.plugins.load_general_plugins()\n"
            "from tq_chunked.vllm_plugin import is_patched\n"
            "assert is_patched(), 'the plugin did not load'\n"
            if load_plugins
            else ""
        )
        + f"sys.exit(pytest.main({args!r}))\n"
    )
    r = subprocess.run(
        [str(python), "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if not report.exists():
        raise AssertionError(
            f"pytest did not run:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
        )
    out = _junit(report)
    out.log = r.stdout[-6000:] + r.stderr[-2000:]
    report.unlink()
    return out


def _rewritten(tests: Path) -> set[str]:
    """The tests of the release that the change rewrites (``classname::name``)."""
    path = tests / VLLM_TEST.relative_to("tests")
    if not path.is_file():
        return set()
    ours = {
        f.name
        for c in ast.parse(RESERVATION.read_text()).body
        if isinstance(c, ast.ClassDef)
        for f in c.body
        if isinstance(f, ast.FunctionDef)
    }
    module = ".".join(VLLM_TEST.with_suffix("").parts)
    return {
        f"{module}.{c.name}::{f.name}"
        for c in ast.parse(path.read_text()).body
        if isinstance(c, ast.ClassDef)
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name in ours
    }


@dataclass
class Release:
    name: str
    python: Path
    src: Path
    as_released: Path  # the release's tests, as they are (a copy of src)
    tree: Path  # the vendored tree, with the tests as the change leaves them


def _vllm_dir(python) -> Path:
    code = (
        "import importlib.util; "
        "print(importlib.util.find_spec('vllm').submodule_search_locations[0])"
    )
    r = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True
    )
    return Path(r.stdout.strip())


@pytest.fixture(scope="module", params=sorted(ENVS) or [None])
def release(request, tmp_path_factory):
    name = request.param
    if name is None:
        pytest.skip("no .vllm-envs/: run tests/install_vllm_cpu.sh")
    src = ENVS[name].parents[1] / "src"
    if not (src / "pyproject.toml").is_file() or not (src / "tests").is_dir():
        pytest.skip(
            f"no {src.relative_to(ROOT)}/ (vLLM's tests from its source "
            "distribution): run tests/install_vllm_cpu.sh, which fetches them"
        )
    base = tmp_path_factory.mktemp(name)
    as_released = base / "as-released"
    shutil.copytree(src, as_released)
    install = _vllm_dir(ENVS[name])
    tree = symlink_farm(install, base / "vendored", src / "tests")
    shutil.copyfile(src / "pyproject.toml", tree / "pyproject.toml")
    r = subprocess.run(
        [str(ENVS[name]), "-m", "tq_chunked.vendor", str(tree)],
        cwd=ROOT,
        env=cpu_test_env(str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert f"added {NEW_TEST.as_posix()}" in r.stdout
    return Release(name, ENVS[name], src, as_released, tree)


def _report(release, mode, outcome):
    print(f"\nvLLM's tests, {release.name}, {mode}: {outcome.line()}")
    for name in sorted(outcome.failed):
        print(f"  failed: {name}")


def test_vllm_tests_pass_on_the_release_as_it_is(release):
    env = cpu_test_env(str(ROOT), TQ_CHUNKED_DISABLE="1")
    outcome = run_vllm_tests(release.python, release.as_released, env)
    _report(release, "unmodified", outcome)
    assert not outcome.failed, outcome.log
    assert outcome.passed


def test_vllm_tests_as_the_change_leaves_them_pass_on_the_vendored_tree(release):
    env = cpu_test_env(
        str(ROOT),
        PYTHONPATH=str(release.tree),
        TQ_CHUNKED_DISABLE="1",
        PYTHONDONTWRITEBYTECODE="1",  # nothing written into the install's links
    )
    outcome = run_vllm_tests(release.python, release.tree, env)
    _report(release, "vendored", outcome)
    assert not outcome.failed, outcome.log
    added = ".".join(NEW_TEST.with_suffix("").parts)
    ran = {n for n in outcome.passed if n.startswith(added + "::")}
    skipped = {n for n in outcome.skipped if n.startswith(added + "::")}
    # Every case of the added test ran; the reservation cases skip only where the
    # release takes no buffers from a WorkspaceManager (0.20.x).
    assert len(ran) >= 18, outcome.log
    assert all("reserves_the_pair" in n for n in skipped)


def test_vllm_tests_as_released_fail_on_the_vendored_tree_only_where_rewritten(
    release,
):
    env = cpu_test_env(
        str(ROOT),
        PYTHONPATH=str(release.tree),
        TQ_CHUNKED_DISABLE="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    outcome = run_vllm_tests(release.python, release.as_released, env)
    _report(release, "vendored, the release's tests as they are", outcome)
    assert outcome.failed == _rewritten(release.as_released / "tests"), outcome.log


def _entry_point(python) -> bool:
    code = (
        "from importlib.metadata import entry_points; "
        "print(any(e.value.startswith('tq_chunked.') "
        "for e in entry_points(group='vllm.general_plugins')))"
    )
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return r.stdout.strip() == "True"


def test_vllm_tests_with_the_plugin_fail_only_where_the_change_rewrites_them(release):
    if not _entry_point(release.python):
        pytest.skip("tq_chunked is not pip-installed in this environment")
    env = cpu_test_env(str(ROOT))
    outcome = run_vllm_tests(release.python, release.as_released, env, True)
    _report(release, "plugin", outcome)
    assert outcome.failed == _rewritten(release.as_released / "tests"), outcome.log


# --- vLLM's lint --------------------------------------------------------------------


def _ruff(*args, cwd):
    r = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache"],
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    return r


def _findings(cwd: Path, files: list[Path]) -> list[tuple[str, str, str]]:
    """(file, rule, message) of ruff check, with the configuration found from ``cwd``
    (the tree's pyproject.toml), line numbers left out."""
    r = _ruff("check", "--output-format", "json", *map(str, files), cwd=cwd)
    return sorted(
        (Path(f["filename"]).name, f["code"], f["message"])
        for f in json.loads(r.stdout)
    )


def _unformatted(cwd: Path, files: list[Path]) -> str:
    r = _ruff("format", "--check", "--diff", *map(str, files), cwd=cwd)
    return "" if r.returncode == 0 else r.stdout + r.stderr


def test_the_vendored_tree_passes_vllms_lint(release, tmp_path):
    if importlib.util.find_spec("ruff") is None:
        pytest.skip(f"ruff is not installed (pip install ruff=={RUFF})")
    version = _ruff("--version", cwd=ROOT).stdout.split()[-1]
    if version != RUFF:
        pytest.skip(f"ruff {version} here; vLLM's pre-commit runs {RUFF}")
    tree = release.tree
    package = sorted((tree / VENDORED_DIR).glob("*.py"))
    added = [tree / NEW_TEST]
    assert package and all(p.is_file() for p in added)
    problems = []
    for path in package + added:
        rel = path.relative_to(tree)
        found = _findings(tree, [rel])
        if found:
            problems.append(f"{rel}: {found}")
    # The edited files: no finding the release's own files do not have.
    edited = [TARGET] + ([VLLM_TEST] if (tree / VLLM_TEST).is_file() else [])
    # The release as it is, in a tree of the same kind (ruff sorts a vllm module as
    # first-party where it finds it under the tree, as in vLLM's checkout).
    old_tree = symlink_farm(_vllm_dir(release.python), tmp_path, release.src / "tests")
    shutil.copyfile(release.src / "pyproject.toml", old_tree / "pyproject.toml")
    for rel in edited:
        new, old = _findings(tree, [rel]), _findings(old_tree, [rel])
        extra = [f for f in new if f not in old]
        if extra:
            problems.append(f"{rel}: {extra} (the release's own file: {old})")
    unformatted = _unformatted(tree, [p.relative_to(tree) for p in package + added])
    unformatted += _unformatted(tree, edited)
    print(
        f"\nruff {RUFF} with {release.name}'s pyproject.toml: "
        f"{len(package)} vendored modules, {NEW_TEST.name}, "
        + ", ".join(p.name for p in edited)
        + f": {len(problems)} files with findings"
    )
    assert not problems, "\n".join(problems)
    assert not unformatted, unformatted


# --- vLLM's pre-commit ----------------------------------------------------------------

# The hooks of vLLM's .pre-commit-config.yaml from other repositories that check Python,
# run as their hooks run them, check-only (vLLM's ruff-check hook passes --fix; here a
# finding fails): {id: (command, the file types their manifest selects)}.
REMOTE_HOOKS = {
    "ruff-check": (
        [
            "ruff",
            "check",
            "--force-exclude",
            "--no-cache",
            "--output-format",
            "concise",
        ],
        {"types_or": ["python", "pyi", "jupyter"]},
    ),
    "ruff-format": (
        ["ruff", "format", "--force-exclude", "--no-cache", "--check", "--diff"],
        {"types_or": ["python", "pyi", "jupyter"]},
    ),
    "typos": (["typos", "--force-exclude"], {"types": ["text"]}),
}
# The checks vLLM's maintainers run that a change of this kind must pass: each must run.
REQUIRED_HOOKS = {
    "ruff-check",
    "ruff-format",
    "typos",
    "mypy",
    "check-spdx-header",
    "check-forbidden-imports",
    "check-boolean-context-manager",
    "check-root-lazy-imports",
    "check-test-tethering",
}
_TAGS = {
    ".py": {"python"},
    ".pyi": {"pyi"},
    ".yaml": {"yaml"},
    ".yml": {"yaml"},
    ".json": {"json"},
}
_READ_CONFIG = """
import json, sys
import yaml
config = yaml.safe_load(open(sys.argv[1]))
hooks = [dict(h, repo=r["repo"]) for r in config["repos"] for h in r["hooks"]]
top = {"exclude": config.get("exclude", "^$"), "files": config.get("files", "")}
print(json.dumps(dict(top, hooks=hooks)))
"""


def _tags(path: str) -> set[str]:
    """The identify tags pre-commit selects the files written here by."""
    return {"file", "text"} | _TAGS.get(Path(path).suffix, set())


def _selects(hook: dict, path: str) -> bool:
    """Whether pre-commit would pass ``path`` to ``hook`` (its files, exclude, types,
    types_or and exclude_types)."""
    tags = _tags(path)
    return (
        re.search(hook.get("files") or "", path) is not None
        and re.search(hook.get("exclude") or "^$", path) is None
        and set(hook.get("types") or ["file"]) <= tags
        and (not hook.get("types_or") or bool(set(hook["types_or"]) & tags))
        and not set(hook.get("exclude_types") or []) & tags
    )


def _link_tree(src: Path, dest: Path) -> None:
    """A copy of ``src`` whose files are hard links (the vendor tool replaces a file
    it edits, so the originals stay as they are); a full copy across file systems."""

    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dest, copy_function=link)


def _stats(root: Path) -> dict[str, tuple]:
    return {
        p.relative_to(root).as_posix(): (p.stat().st_ino, p.stat().st_size)
        for p in root.rglob("*")
        if p.is_file()
    }


def test_the_vendored_change_passes_vllms_pre_commit(release, tmp_path):
    """The release's own pre-commit checks, as its .pre-commit-config.yaml runs them
    (its tools at its pins, its tools/pre_commit/ scripts, its pyproject.toml), on
    every file ``python -m tq_chunked.vendor`` writes into the release's source tree:
    each hook whose filters select one of them, among those that check Python (the
    local Python hooks, ruff, typos, mypy for Python 3.11). Offline and on the CPU:
    ``tests/install_vllm_cpu.sh`` fetches the tree and the tools
    (``.vllm-envs/vllm-<newest>/pre-commit/``)."""
    pre_commit = release.python.parents[1] / "pre-commit"
    if not (pre_commit / "ready").is_file():
        pytest.skip(
            f"no {pre_commit.relative_to(ROOT)}/: tests/install_vllm_cpu.sh fetches "
            "vLLM's pre-commit checks for the newest release it builds"
        )
    venv = pre_commit / "venv"
    python = str(venv / "bin" / "python")
    tree = tmp_path / "vllm"
    _link_tree(pre_commit / "tree", tree)
    before = _stats(tree)
    r = subprocess.run(
        [sys.executable, "-m", "tq_chunked.vendor", str(tree)],
        cwd=ROOT,
        env=cpu_test_env(str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    after = _stats(tree)
    written = sorted(p for p in after if before.get(p) != after[p])
    assert NEW_TEST.as_posix() in written and len(written) >= 13, written
    # The vendored folders as mkdir makes them (0755 under the umask tests run with).
    mode = (tree / VENDORED_DIR).stat().st_mode & 0o777
    assert mode == 0o777 & ~_umask(), oct(mode)
    config = json.loads(
        subprocess.run(
            [python, "-c", _READ_CONFIG, str(tree / ".pre-commit-config.yaml")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    ran, not_run, failures = [], [], []
    for hook in config["hooks"]:
        files = [
            p
            for p in written
            if re.search(config["files"], p) and not re.search(config["exclude"], p)
        ]
        stages = hook.get("stages") or ["pre-commit"]
        remote = REMOTE_HOOKS.get(hook["id"]) if hook["repo"] != "local" else None
        if remote is not None:
            command, selection = remote
            files = [p for p in files if _selects(dict(hook, **selection), p)]
        else:
            files = [p for p in files if _selects(hook, p)]
            command = [
                python if word == "python" else word
                for word in shlex.split(hook.get("entry", ""))
            ] + list(hook.get("args") or [])
        if not files or "pre-commit" not in stages:
            continue
        if hook.get("always_run") and not hook.get("files"):
            not_run.append(f"{hook['id']} (on every commit: the repository, not files)")
            continue
        if remote is None and hook["repo"] != "local":
            not_run.append(f"{hook['id']} (from {hook['repo']}: not a Python check)")
            continue
        if remote is None and hook.get("language") != "python":
            not_run.append(f"{hook['id']} ({hook.get('language')}: not a Python check)")
            continue
        if hook.get("pass_filenames", True):
            command += files
        result = subprocess.run(
            command, cwd=tree, env=env, capture_output=True, text=True, timeout=900
        )
        ran.append(hook["id"])
        if result.returncode != 0:
            failures.append(
                f"{hook['id']} ({' '.join(command[:4])} ...):\n"
                f"{result.stdout[-4000:]}{result.stderr[-2000:]}"
            )
    print(
        f"\n{release.name}'s pre-commit on the {len(written)} files the vendor "
        f"tool writes: ran {', '.join(ran)}; {len(failures)} failed"
        + (f"; not run: {', '.join(not_run)}" if not_run else "")
    )
    assert set(ran) >= REQUIRED_HOOKS, REQUIRED_HOOKS - set(ran)
    assert not failures, "\n\n".join(failures)
    # Without the Buildkite job the tool adds, the added test is refused.
    (tree / CI_JOBS).unlink()  # never write through a hard link into the install
    shutil.copyfile(pre_commit / "tree" / CI_JOBS, tree / CI_JOBS)
    r = subprocess.run(
        [python, "tools/pre_commit/check_test_tethering.py", NEW_TEST.as_posix()],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"error: {NEW_TEST.as_posix()} is not run by any Buildkite job" in r.stdout


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
