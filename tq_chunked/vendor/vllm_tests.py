"""Step 3: vLLM's tests as the change needs them, in a tree that has vLLM's ``tests/``
(a checkout; a site-packages directory has none).

* ``tests/quantization/test_turboquant.py``: where it has
  ``TestTurboQuantWorkspaceReservation`` (vLLM 0.24 onwards), the methods that assert
  the (1, Hk, max_model_len, D) continuation pair are replaced by the ones in
  ``tq_chunked/upstream_tests/turboquant_reservation.py``, which assert tq_chunked's
  workspace in its place;
* ``tests/quantization/test_turboquant_chunked_prefill.py``: added, from
  ``tq_chunked/upstream_tests/``;
* ``.buildkite/test_areas/quantization.yaml``, where the tree has it (a checkout): a
  job that runs the added test, as vLLM's pipelines run its tests (vLLM's pre-commit
  refuses a test file no Buildkite job runs).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .package import PACKAGE_DIR, header
from .paths import CI_JOBS, CI_KEY, NEW_TEST, PACKAGE, TARGET, VENDORED_DIR, VendorError
from .source import Edit, apply_edits, first_line

UPSTREAM_DIR = PACKAGE_DIR / "upstream_tests"
RESERVATION = UPSTREAM_DIR / "turboquant_reservation.py"
RESERVATION_CLASS = "TestTurboQuantWorkspaceReservation"
SPDX = "# SPDX-"


def _origin(path: Path) -> str:
    return f"{PACKAGE}/{path.relative_to(PACKAGE_DIR).as_posix()}"


def new_test_text() -> str:
    """The test file the change adds, under the header of the vendored files."""
    source = UPSTREAM_DIR / NEW_TEST.name
    lines = source.read_text().splitlines(keepends=True)
    while lines and lines[0].startswith(SPDX):  # the header brings its own
        lines.pop(0)
    return header(_origin(source)) + "".join(lines)


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {s.name: s for s in cls.body if isinstance(s, ast.FunctionDef)}


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next(
        (s for s in tree.body if isinstance(s, ast.ClassDef) and s.name == name), None
    )


def edited_vllm_test(text: str) -> tuple[str | None, list[str]]:
    """(vLLM's test_turboquant.py with the reservation tests rewritten, or None where
    it has none to rewrite; notes). A method of that class whose name the template has
    but that does not build the metadata builder is left as it is, with a note."""
    tree = ast.parse(text)
    cls = _class(tree, RESERVATION_CLASS)
    if cls is None:
        return None, []
    template_text = RESERVATION.read_text()
    template = _class(ast.parse(template_text), RESERVATION_CLASS)
    if template is None:
        raise VendorError(
            f"internal: {_origin(RESERVATION)} has no {RESERVATION_CLASS}"
        )
    template_lines = template_text.splitlines()
    theirs, edits, notes = _methods(cls), [], []
    for name, ours in _methods(template).items():
        method = theirs.get(name)
        if method is None or "TurboQuantMetadataBuilder" not in ast.unparse(method):
            notes.append(
                f"note: {RESERVATION_CLASS}.{name} not found in its expected shape in "
                "tests/quantization/test_turboquant.py; left as it is"
            )
            continue
        new = template_lines[first_line(ours) : ours.end_lineno]
        edits.append(Edit(first_line(method), method.end_lineno, new, name))
    return (apply_edits(text, edits) if edits else None), notes


# The job, in the style of the pipeline's other GPU jobs (the TurboQuant ones run on
# an H200 slice); its commands run in vLLM's tests/ directory. On a GPU the added test
# writes the cache with vLLM's store kernel and attends with vLLM's FlashAttention.
CI_STEP = f"""\
- label: ":nvidia: (H200 MIG 18GB) TurboQuant chunked prefill"
  key: {CI_KEY}
  timeout_in_minutes: 20
  device: h200_18gb
  source_file_dependencies:
  - vllm/model_executor/layers/quantization/turboquant/
  - {TARGET.as_posix()}
  - {VENDORED_DIR.as_posix()}/
  - vllm/v1/attention/ops/triton_turboquant_store.py
  - vllm/v1/worker/workspace.py
  - {NEW_TEST.as_posix()}
  commands:
  - pytest -v -s {NEW_TEST.relative_to("tests").as_posix()}
"""
_TOP_KEY = re.compile(r"^[A-Za-z_][\w-]*:")
_ITEM = re.compile(r"^(\s*)- ")


def edited_ci_jobs(text: str) -> tuple[str | None, list[str]]:
    """(vLLM's quantization pipeline with the added test's job appended to its
    ``steps``, or None where the file is not of the expected shape; notes). The job
    is appended as text, at the indentation of the pipeline's other steps, so that
    nothing else in the file changes."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.rstrip() == "steps:"]
    if len(starts) != 1 or any(_TOP_KEY.match(x) for x in lines[starts[0] + 1 :]):
        note = (
            f"note: {CI_JOBS.as_posix()} has no 'steps:' list that ends the file; "
            f"{NEW_TEST.as_posix()} is not wired into a Buildkite job (vLLM's "
            "pre-commit asks for one)"
        )
        return None, [note]
    items = [
        m.group(1)
        for line in lines[starts[0] + 1 :]
        if (m := _ITEM.match(line)) and not line.lstrip().startswith("#")
    ]
    indent = items[0] if items else ""
    step = "".join(
        indent + line if line.strip() else line
        for line in CI_STEP.splitlines(keepends=True)
    )
    return text + ("" if text.endswith("\n") else "\n") + "\n" + step, []


def has_ci_job(text: str) -> bool:
    """Whether vLLM's quantization pipeline (``text``) has the added test's job."""
    return re.search(rf"^\s*key: {re.escape(CI_KEY)}\s*$", text, re.M) is not None
