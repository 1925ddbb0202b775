"""The command: checks the tree, prints the diffs, writes everything or nothing."""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .. import __version__
from .edits import is_vendored, vendored_text
from .package import package_files
from .paths import (
    CI_JOBS,
    NEW_TEST,
    TARGET,
    VENDORED,
    VENDORED_DIR,
    VLLM_TEST,
    VendorError,
)
from .vllm_tests import edited_ci_jobs, edited_vllm_test, has_ci_job, new_test_text


def _diff(old: str, new: str, path: Path) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            fromfile=f"a/{path.as_posix()}",
            tofile=f"b/{path.as_posix()}",
        )
    )


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_package(ops_dir: Path, files: dict[str, str]) -> Path:
    """The package written next to its place, then renamed into it (never half
    there). The directory gets the mode ``mkdir`` gives (0755 under the usual umask
    022), not the private 0700 of the temporary directory it was written in."""
    tmp = Path(tempfile.mkdtemp(prefix=".tq_chunked-", dir=ops_dir))
    try:
        for name, text in files.items():
            (tmp / name).write_text(text)
        tmp.chmod(0o777 & ~_umask())
        target = ops_dir / VENDORED_DIR.name
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _write_file(path: Path, text: str) -> None:
    """``text`` written next to ``path``, then moved onto it (never half written)."""
    tmp = path.with_name(path.name + ".tq_chunked-tmp")
    tmp.write_text(text)
    if path.exists():
        shutil.copymode(path, tmp)
    os.replace(tmp, path)


def _refuse_vendored(
    root: Path, files: dict[str, str], new_test: str | None, ci_text: str | None
) -> None:
    """A tree that already calls the vendored package: fine (nothing to do) if it holds
    exactly what this tq_chunked writes, refused otherwise."""
    package_dir = root / VENDORED_DIR
    same = (
        package_dir.is_dir()
        and {p.name: p.read_text() for p in package_dir.glob("*.py")} == files
    )
    test = root / NEW_TEST
    if new_test is not None and test.is_file():
        same = same and test.read_text() == new_test
    if ci_text is not None:
        same = same and has_ci_job(ci_text)
    if not same:
        raise VendorError(
            f"{TARGET} already calls {VENDORED}, but {VENDORED_DIR}/ (or {NEW_TEST}, "
            f"or {CI_JOBS}) is not what tq_chunked {__version__} writes (another "
            f"version, or edited): restore vLLM's {TARGET} (and {VLLM_TEST}, "
            f"{CI_JOBS}), remove {VENDORED_DIR}/ and {NEW_TEST} (in a checkout: git "
            f"checkout -- {TARGET} {VLLM_TEST} {CI_JOBS}; rm -r {VENDORED_DIR} "
            f"{NEW_TEST}), then run this again"
        )


def _read_python(root: Path, rel: Path) -> str:
    """The text of vLLM's file ``rel``, refused by name where it does not parse (the
    tool reads it with ``ast``)."""
    text = (root / rel).read_text()
    try:
        ast.parse(text)
    except SyntaxError as e:
        raise VendorError(
            f"{root / rel} does not parse as Python (line {e.lineno}: {e.msg}): "
            "not a vLLM source file this tool can edit"
        ) from None
    return text


def vendor(root: Path, check: bool = False, out=None) -> int:
    """Vendor tq_chunked into the vLLM tree ``root``; prints the diffs and what is
    added to ``out``. Returns the exit status (VendorError for a refusal)."""
    out = out or sys.stdout
    target = root / TARGET
    if not target.is_file():
        raise VendorError(
            f"{target} does not exist: VLLM_SOURCE_DIR must contain the vllm/ package "
            "(a vLLM checkout or site-packages) with the TurboQuant backend"
        )
    package_dir = root / VENDORED_DIR
    if not package_dir.parent.is_dir():
        raise VendorError(
            f"{package_dir.parent} is not a directory: the vllm/ package in "
            "VLLM_SOURCE_DIR has no vllm/v1/attention/ops/, where the vendored "
            "package goes (not a vLLM source tree of a release this tool knows)"
        )
    files = package_files()
    text = _read_python(root, TARGET)
    # vLLM's tests and their Buildkite pipelines, where the tree has them (a checkout).
    has_tests = (root / NEW_TEST).parent.is_dir()
    new_test = new_test_text() if has_tests else None
    ci_path = root / CI_JOBS
    ci_text = ci_path.read_text() if has_tests and ci_path.is_file() else None
    if is_vendored(text):
        _refuse_vendored(root, files, new_test, ci_text)
        print(
            f"{TARGET} already calls {VENDORED}, and {VENDORED_DIR}/ holds what "
            f"tq_chunked {__version__} writes: nothing to do",
            file=out,
        )
        return 0
    for path in (package_dir, root / NEW_TEST):
        if path.exists():
            raise VendorError(
                f"{path} exists but {TARGET} does not call {VENDORED}: remove it (a "
                "copy from another tool or an interrupted run), then run this again"
            )
    if ci_text is not None and has_ci_job(ci_text):
        raise VendorError(
            f"{ci_path} already has the job of {NEW_TEST} but {TARGET} does not call "
            f"{VENDORED}: restore it (git checkout -- {CI_JOBS}), then run this again"
        )
    new, notes = vendored_text(text)
    edits = [(TARGET, text, new)]
    if has_tests and (root / VLLM_TEST).is_file():
        test_text = _read_python(root, VLLM_TEST)
        test_new, test_notes = edited_vllm_test(test_text)
        notes += test_notes
        if test_new is not None:
            edits.append((VLLM_TEST, test_text, test_new))
    if ci_text is not None:
        ci_new, ci_notes = edited_ci_jobs(ci_text)
        notes += ci_notes
        if ci_new is not None:
            edits.append((CI_JOBS, ci_text, ci_new))
    elif has_tests:
        notes.append(
            f"note: no {CI_JOBS.as_posix()} in this tree: {NEW_TEST.as_posix()} is "
            "not wired into a Buildkite job (vLLM's pre-commit asks for one)"
        )
    for rel, old, edited in edits:
        out.write(_diff(old, edited, rel))
    if not check:
        _write_all(root, files, edits, new_test)
    verb = "would add" if check else "added"
    print(
        f"{verb} {VENDORED_DIR.as_posix()}/ ({len(files)} files from tq_chunked "
        f"{__version__}: {', '.join(sorted(files))})"
        + ("; --check: nothing written" if check else ""),
        file=out,
    )
    if new_test is not None:
        print(f"{verb} {NEW_TEST.as_posix()}", file=out)
    else:
        print(
            "note: no tests/quantization/ in this tree (not a checkout): vLLM's tests "
            "are neither edited nor added",
            file=out,
        )
    for note in notes:
        print(note, file=out)
    return 0


def _write_all(root, files, edits, new_test) -> None:
    """The package, the edited files (``edits``: (path in the tree, old text, new
    text)) and the new test, or, if anything fails, none of them."""
    written = _write_package((root / VENDORED_DIR).parent, files)
    done: list[tuple[Path, str | None]] = []  # (path, text to restore; None: remove)
    try:
        for rel, old, new in edits:
            _write_file(root / rel, new)
            done.append((root / rel, old))
        if new_test is not None:
            _write_file(root / NEW_TEST, new_test)
            done.append((root / NEW_TEST, None))
    except BaseException:
        for path, old in reversed(done):
            if old is None:
                path.unlink()
            else:
                _write_file(path, old)
        shutil.rmtree(written)
        raise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tq_chunked.vendor",
        description="Write tq_chunked into a vLLM source tree as a vendored change: "
        f"the package as {VENDORED}, vLLM's turboquant_attn.py calling it, and, in a "
        "checkout, vLLM's tests for it. Prints the diffs.",
    )
    parser.add_argument(
        "vllm_source_dir",
        type=Path,
        metavar="VLLM_SOURCE_DIR",
        help="the directory holding the vllm/ package (a vLLM checkout, or "
        "site-packages)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="print the diffs and the files; write nothing",
    )
    args = parser.parse_args(argv)
    try:
        return vendor(args.vllm_source_dir, check=args.check)
    except VendorError as e:
        print(f"tq_chunked.vendor: {e}; nothing written", file=sys.stderr)
        return 1
    except OSError as e:  # what was written is undone (_write_all)
        print(
            f"tq_chunked.vendor: writing failed ({e}); nothing written", file=sys.stderr
        )
        return 1
