"""The command: checks the tree, prints the diffs, writes everything or nothing."""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .. import __version__
from .edits import is_vendored, vendored_text
from .package import package_files
from .paths import NEW_TEST, TARGET, VENDORED, VENDORED_DIR, VLLM_TEST, VendorError
from .vllm_tests import edited_vllm_test, new_test_text


def _diff(old: str, new: str, path: Path) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            fromfile=f"a/{path.as_posix()}",
            tofile=f"b/{path.as_posix()}",
        )
    )


def _write_package(ops_dir: Path, files: dict[str, str]) -> Path:
    """The package written next to its place, then renamed into it (never half
    there)."""
    tmp = Path(tempfile.mkdtemp(prefix=".tq_chunked-", dir=ops_dir))
    for name, text in files.items():
        (tmp / name).write_text(text)
    target = ops_dir / VENDORED_DIR.name
    tmp.rename(target)
    return target


def _write_file(path: Path, text: str) -> None:
    """``text`` written next to ``path``, then moved onto it (never half written)."""
    tmp = path.with_name(path.name + ".tq_chunked-tmp")
    tmp.write_text(text)
    if path.exists():
        shutil.copymode(path, tmp)
    os.replace(tmp, path)


def _refuse_vendored(root: Path, files: dict[str, str], new_test: str | None) -> None:
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
    if not same:
        raise VendorError(
            f"{TARGET} already calls {VENDORED}, but {VENDORED_DIR}/ (or {NEW_TEST}) "
            f"is not what tq_chunked {__version__} writes (another version, or "
            f"edited): restore vLLM's {TARGET} (and {VLLM_TEST}), remove "
            f"{VENDORED_DIR}/ and {NEW_TEST} (in a checkout: git checkout -- {TARGET} "
            f"{VLLM_TEST}; rm -r {VENDORED_DIR} {NEW_TEST}), then run this again"
        )


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
    files = package_files()
    # vLLM's tests, where the tree has them (a checkout).
    has_tests = (root / NEW_TEST).parent.is_dir()
    new_test = new_test_text() if has_tests else None
    text = target.read_text()
    if is_vendored(text):
        _refuse_vendored(root, files, new_test)
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
    new, notes = vendored_text(text)
    test_path, test_text, test_new = root / VLLM_TEST, None, None
    if has_tests and test_path.is_file():
        test_text = test_path.read_text()
        test_new, test_notes = edited_vllm_test(test_text)
        notes += test_notes
    out.write(_diff(text, new, TARGET))
    if test_new is not None:
        out.write(_diff(test_text, test_new, VLLM_TEST))
    if not check:
        _write_all(root, files, text, new, test_text, test_new, new_test)
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


def _write_all(root, files, text, new, test_text, test_new, new_test) -> None:
    """The package, the edited files and the new test, or, if anything fails, none of
    them."""
    written = _write_package((root / VENDORED_DIR).parent, files)
    done: list[tuple[Path, str | None]] = []  # (path, text to restore; None: remove)
    try:
        _write_file(root / TARGET, new)
        done.append((root / TARGET, text))
        if test_new is not None:
            _write_file(root / VLLM_TEST, test_new)
            done.append((root / VLLM_TEST, test_text))
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
