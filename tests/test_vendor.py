"""``python -m tq_chunked.vendor``: the vendored change, written into real vLLM
installs.

* The tool on each ``.vllm-envs/`` release's turboquant_attn.py (text only, seconds):
  what it rewires, per release line, and that it leaves every other statement of the
  file as it was (bar the imports only the replaced bodies used); the package copy
  (runtime modules only, no import of ``tq_chunked`` by name).
* The tool refuses a file of another shape, naming what it did not find, and writes
  nothing; run twice, it says there is nothing to do; in a tree with vLLM's tests it
  rewrites the reservation tests and adds its own.
* The vendored vLLM runs ``tests/test_vllm_plugin.py`` (its vendored mode: vLLM's own
  classes as the tool left them, the plugin off), in a tree of symlinks to the install
  (``vllm_harness.symlink_farm``: vLLM's package is about 0.9 GB). CI runs this for the
  newest release found (0.34.0); ``TQ_CHUNKED_VENDOR_ENVS=all`` runs it for every
  environment found (or a comma-separated list of names, e.g.
  ``vllm-0.20.2,vllm-0.23.0``). vLLM's own tests on the vendored tree, and vLLM's lint
  and pre-commit checks of it, are ``tests/test_vllm_upstream.py``.

From an environment without vLLM the vendored runs use each ``.vllm-envs/``
environment's Python (``bash tests/install_vllm_cpu.sh`` builds them); inside an
environment with vLLM, its own.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tq_chunked import vendor
from tq_chunked.tools.vllm_harness import cpu_test_env, symlink_farm, vllm_envs
from tq_chunked.vendor import (
    CI_JOBS,
    CI_KEY,
    NEW_TEST,
    STATE,
    TARGET,
    VENDORED,
    VENDORED_DIR,
    VLLM_TEST,
    VendorError,
)

ROOT = Path(__file__).resolve().parent.parent
HAS_VLLM = importlib.util.find_spec("vllm") is not None
ENVS = vllm_envs(ROOT)
# CI vendors into the newest release found (0.34.0 as tests/install_vllm_cpu.sh builds).
CI_ENVS = tuple(ENVS)[-1:]
# tests/test_vllm_plugin.py's WINDOW (its vendored mode checks the module read this one)
WINDOW = "64"
# What vLLM gets: the runtime directory, whole.
RUNTIME_MODULES = {p.name for p in (ROOT / "tq_chunked" / "runtime").glob("*.py")}
IMPL, BUILDER = "TurboQuantAttentionImpl", "TurboQuantMetadataBuilder"
RESERVE = f"{STATE}.reserve(self, {IMPL})"


def _pythons():
    """(id, python) of the vLLM installs to vendor into: this one if it has vLLM, else
    the .vllm-envs/ ones."""
    if HAS_VLLM:
        return [pytest.param(sys.executable, id="this-python")]
    if not ENVS:
        return [pytest.param(None, id="no-vllm-envs")]
    return [pytest.param(python, id=name) for name, python in ENVS.items()]


def vllm_dir(python) -> Path:
    """The installed vllm package's directory, without importing vLLM."""
    code = (
        "import importlib.util; "
        "print(importlib.util.find_spec('vllm').submodule_search_locations[0])"
    )
    r = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return Path(r.stdout.strip())


def _needs(python):
    if python is None:
        pytest.skip(
            "no .vllm-envs/: run tests/install_vllm_cpu.sh to vendor into real vLLM "
            "installs"
        )


# --- the tool on each release's file ------------------------------------------------


def _parts(tree):
    """{key: node} of a module's parts other than its imports: its top-level statements
    (functions and classes by name, others by their first line and occurrence) and the
    methods of its classes (a class itself stands for its header: name, bases,
    decorators)."""
    out, seen = {}, {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(stmt, ast.ClassDef):
            for j, s in enumerate(stmt.body):
                out[f"{stmt.name}.{getattr(s, 'name', f'<{j}>')}"] = s
            header = copy.copy(stmt)
            header.body = []
            out[stmt.name] = header
        else:
            key = getattr(stmt, "name", None) or ast.unparse(stmt).splitlines()[0]
            seen[key] = seen.get(key, 0) + 1
            out[key if seen[key] == 1 else f"{key} #{seen[key]}"] = stmt
    return out


def _imported(tree):
    """{(module, name, asname)} of a module's top-level imports."""
    out = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom):
            out |= {(stmt.module, a.name, a.asname) for a in stmt.names}
        elif isinstance(stmt, ast.Import):
            out |= {(None, a.name, a.asname) for a in stmt.names}
    return out


def _used(tree):
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _signature_and_docstring(fn):
    return ast.dump(fn.args), ast.get_docstring(fn)


def _features(tree, old):
    has_reserve = f"{BUILDER}._reserve_workspace" in old
    uses_manager = any(
        isinstance(s, ast.ImportFrom)
        and "current_workspace_manager" in [a.name for a in s.names]
        for s in tree.body
    )
    host_copies = any(
        isinstance(s, ast.AnnAssign) and ast.unparse(s.target) == "query_start_loc_cpu"
        for s in ast.walk(tree)
    )
    return has_reserve, uses_manager, host_copies


@pytest.mark.parametrize("name", list(ENVS) or [None])
def test_the_tool_rewires_each_release_and_touches_nothing_else(name):
    if name is None:
        pytest.skip("no .vllm-envs/: run tests/install_vllm_cpu.sh")
    old_text = (vllm_dir(ENVS[name]) / TARGET.relative_to("vllm")).read_text()
    new_text, notes = vendor.vendored_text(old_text)
    old_tree, new_tree = ast.parse(old_text), ast.parse(new_text)
    old, new = _parts(old_tree), _parts(new_tree)
    has_reserve, uses_manager, host_copies = _features(old_tree, old)
    # Imports: the vendored module's names added; removed, exactly the names the
    # replaced bodies alone used.
    names = {"ChunkedPrefill", "window_from_env"}
    names |= set() if host_copies else {"attach_host_lengths"}
    module = f"{VENDORED}.vllm_backend"
    assert _imported(new_tree) - _imported(old_tree) == {
        (module, n, None) for n in names
    }
    removed = _imported(old_tree) - _imported(new_tree)
    for _, imported, asname in removed:
        bound = asname or imported.split(".")[0]
        assert bound in _used(old_tree) and bound not in _used(new_tree)
    if removed:
        [note] = notes
        head, listed = note.rsplit(": ", 1)
        assert head == "note: imports only the replaced method bodies used, removed"
        assert sorted(listed.split(", ")) == sorted(
            asname or n for _, n, asname in removed
        )
    else:
        assert notes == []
    # Every other part: one added (the module-level ChunkedPrefill), the rest kept, and
    # exactly the parts the docs name changed.
    added = sorted(new.keys() - old.keys())
    assert len(added) == 1 and old.keys() - new.keys() == set()
    hooks = "__name__" if uses_manager else "None"
    assert added == [
        f"{STATE} = ChunkedPrefill(hooks={hooks}, window=window_from_env())"
    ]
    changed = {k for k in old if ast.dump(old[k]) != ast.dump(new[k])}
    expected = {f"{IMPL}._prefill_attention", f"{IMPL}._continuation_prefill"}
    if has_reserve:
        expected.add(f"{BUILDER}._reserve_workspace")
    elif uses_manager:
        expected.add(f"{BUILDER}.__init__")
    expected.add(f"{BUILDER}.build")
    assert changed == expected
    for key in changed:
        assert _signature_and_docstring(old[key]) == _signature_and_docstring(new[key])
        assert STATE in ast.unparse(new[key])
    # The methods: one call each (the whole body, or, where the body serves the
    # struct-of-arrays layout, an early return before it, the body unchanged).
    calls = {
        "_prefill_attention": f"return {STATE}.prefill_attention(self, query, key, "
        "value, kv_cache, attn_metadata, Pi, centroids)",
        "_continuation_prefill": f"return {STATE}.continuation_prefill(self, query, "
        "key_chunk, val_chunk, kv_cache, block_table, cached_len, seq_len, Pi, "
        "centroids)",
    }
    for method, call in calls.items():
        o, n = old[f"{IMPL}.{method}"], new[f"{IMPL}.{method}"]
        skip = 1 if ast.get_docstring(o) is not None else 0
        body = n.body[skip:]
        if "self._soa_store" in ast.unparse(o):
            assert ast.unparse(body[0]) == f"if not self._soa_store:\n    {call}"
            assert [ast.dump(s) for s in body[1:]] == [
                ast.dump(s) for s in o.body[skip:]
            ]
        else:
            assert [ast.unparse(s) for s in body] == [call]
    if has_reserve:
        # vLLM's statements all kept; before the continuation pair, tq_chunked's
        # reservation, and an early return for builders whose layers all run it.
        o = old[f"{BUILDER}._reserve_workspace"]
        n = new[f"{BUILDER}._reserve_workspace"]
        src = [ast.unparse(s) for s in n.body]
        i = src.index(f"if {RESERVE}:\n    return")
        assert [ast.dump(s) for s in n.body[:i] + n.body[i + 1 :]] == [
            ast.dump(s) for s in o.body
        ]
        assert "get_simultaneous" in src[i - 1] and "max_model_len" in "".join(
            src[i + 1 :]
        )
    elif uses_manager:
        assert ast.unparse(new[f"{BUILDER}.__init__"].body[-1]) == RESERVE
    # build: the metadata kept, the host copies attached where it has none (0.20.x),
    # the step planned, the metadata returned
    attach = "attach_host_lengths(metadata, common_attn_metadata, self.vllm_config)"
    build = [ast.unparse(s) for s in new[f"{BUILDER}.build"].body]
    assert build[-2:] == [
        f"{STATE}.plan_step(self, metadata, {IMPL})",
        "return metadata",
    ]
    assert (build[-3] == attach) == (not host_copies)
    assert all(
        len(line) <= vendor.LINE
        for line in new_text.splitlines()
        if line not in old_text.splitlines()
    )
    print(name, notes)


def test_the_package_copy_is_the_runtime_modules_importing_nothing_by_the_name():
    files = vendor.package_files()
    assert set(files) == RUNTIME_MODULES
    for name, text in files.items():
        assert text.startswith("# SPDX-License-Identifier: Apache-2.0\n")
        assert all(len(line) <= vendor.LINE for line in text.splitlines()[:6])
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert (
                    node.module.split(".")[0]
                    in {"torch", "vllm"} | sys.stdlib_module_names
                ), name
            elif isinstance(node, ast.Import):
                assert all(
                    a.name.split(".")[0] not in ("tq_chunked", "triton")
                    for a in node.names
                ), name
    # Same code as this checkout's, header and Triton's import aside (taken from
    # vllm.triton_utils, as vLLM's pre-commit asks).
    for name, text in files.items():
        source = (ROOT / "tq_chunked" / "runtime" / name).read_text()
        assert text.endswith(vendor.rewrite_triton_imports(name[:-3], source))
        assert ("import triton" in source) == (
            "from vllm.triton_utils import tl, triton\n" in text
        )


# (source, vendored) of rewrite_triton_imports, its sections as ruff's isort sorts them.
TRITON_CASES = {
    "own-section": (  # a section of its own, before the relative imports
        """\
import os

import torch
import triton
import triton.language as tl

from ._utils import x
""",
        """\
import os

import torch

from vllm.triton_utils import tl, triton

from ._utils import x
""",
    ),
    "emptied-section": (  # the third-party section emptied; no relative imports
        """\
\"\"\"Doc.\"\"\"

import os

import triton


def f():
    pass
""",
        """\
\"\"\"Doc.\"\"\"

import os

from vllm.triton_utils import triton


def f():
    pass
""",
    ),
    "among-vllm": (  # among the module's vllm imports, in isort's order
        """\
import torch
import triton.language as tl

import vllm.envs as envs
from vllm.platforms import p
from vllm.utils import (
    u,
)
""",
        """\
import torch

import vllm.envs as envs
from vllm.platforms import p
from vllm.triton_utils import tl
from vllm.utils import (
    u,
)
""",
    ),
    "no-triton": ("import torch\n\nX = 1\n", "import torch\n\nX = 1\n"),
}


@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_tritons_imports_are_taken_from_vllm(case):
    source, vendored = TRITON_CASES[case]
    assert vendor.rewrite_triton_imports("m", source) == vendored


@pytest.mark.parametrize(
    "source",
    [
        "from triton import cdiv\n",
        "import triton as t\n",
        "import triton.language\n",
        "def f():\n    import triton\n",
        "try:\n    import triton\nexcept ImportError:\n    pass\n",
    ],
)
def test_another_import_of_triton_is_refused_by_name(source):
    with pytest.raises(
        VendorError, match=r"m\.py:\d: '.*triton.*': the vendored copy takes Triton"
    ):
        vendor.rewrite_triton_imports("m", source)


def test_imports_of_the_package_by_name_are_made_relative_or_refused():
    text = (
        "from tq_chunked.runtime.format import TQConfig\n"
        "from tq_chunked.runtime import workspace\n"
        "def f():\n"
        "    import tq_chunked.runtime.plan as plan\n"
        "    from .merge import merge_attn_states\n"
    )
    assert vendor.rewrite_imports("m", text) == (
        "from .format import TQConfig\n"
        "from . import workspace\n"
        "def f():\n"
        "    from . import plan as plan\n"
        "    from .merge import merge_attn_states\n"
    )
    with pytest.raises(
        VendorError,
        match="m.py:2: 'import tq_chunked.runtime.plan' binds the name tq_chunked",
    ):
        vendor.rewrite_imports("m", "x = 1\nimport tq_chunked.runtime.plan\n")
    with pytest.raises(VendorError, match="imports tq_chunked outside its runtime"):
        vendor.check_imports("m", "from tq_chunked.tools import testing\n", {"m"})
    with pytest.raises(
        VendorError, match="imports einops, which vLLM does not depend on"
    ):
        vendor.check_imports("m", "import einops\n", {"m"})
    with pytest.raises(VendorError, match="imports .bench, which is not copied"):
        vendor.check_imports("m", "from .bench import x\n", {"m"})


# --- refusals and a second run, on a file of the 0.21-0.23 shape --------------------

SHAPE = '''\
import torch

from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.worker.workspace import current_workspace_manager

_CONTINUATION_DECODE_THRESHOLD = 128


class TurboQuantMetadata(AttentionMetadata):
    seq_lens: torch.Tensor
    query_start_loc_cpu: torch.Tensor | None = None


class TurboQuantMetadataBuilder:
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        self.kv_cache_spec = kv_cache_spec

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return TurboQuantMetadata(seq_lens=common_attn_metadata.seq_lens)


class TurboQuantAttentionImpl:
    def _prefill_attention(self, query, key, value, kv_cache, attn_metadata, Pi,
                           centroids, PiT=None, layer=None):
        return query

    def _continuation_prefill(self, layer, query, key_chunk, val_chunk, kv_cache,
                              block_table, cached_len, seq_len, Pi, centroids):
        """Dequant the cached K/V."""
        return query
'''

# vLLM's tests/quantization/test_turboquant.py, in the shape of 0.24 onwards (the
# reservation tests' bodies do not matter to the tool).
VLLM_TEST_SHAPE = """\
import torch


class TestTurboQuantWorkspaceReservation:
    @staticmethod
    def _fake_vllm_config(**kwargs):
        return None

    def test_metadata_builder_reserves_decode_and_continuation_prefill_workspace(
        self, monkeypatch
    ):
        from vllm.v1.attention.backends import turboquant_attn

        turboquant_attn.TurboQuantMetadataBuilder()
        assert False

    def test_metadata_builder_skips_continuation_prefill_when_disabled(
        self, monkeypatch
    ):
        from vllm.v1.attention.backends import turboquant_attn

        turboquant_attn.TurboQuantMetadataBuilder()
        assert False


class TestCentroids:
    def test_centroids(self):
        assert True
"""


def _tree(tmp_path, text, tests=None):
    path = tmp_path / TARGET
    path.parent.mkdir(parents=True)
    (tmp_path / VENDORED_DIR.parent).mkdir(parents=True)
    path.write_text(text)
    if tests is not None:
        (tmp_path / VLLM_TEST).parent.mkdir(parents=True)
        if tests:
            (tmp_path / VLLM_TEST).write_text(tests)
    return path


def _run(tmp_path, *flags):
    out, err = io.StringIO(), io.StringIO()
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        rc = vendor.main([str(tmp_path), *flags])
    finally:
        sys.stdout, sys.stderr = stdout, stderr
    return rc, out.getvalue(), err.getvalue()


def _snapshot(root):
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize(
    "mutation, named",
    [
        (
            (
                "def _continuation_prefill(self, layer, query,",
                "def _continuation_prefill(self, query,",
            ),
            [f"{IMPL}._continuation_prefill('self', 'layer', 'query', 'key_chunk'"],
        ),
        (
            ("class TurboQuantMetadataBuilder:", "class MetadataBuilder:"),
            ["class TurboQuantMetadataBuilder"],
        ),
        (
            ("_prefill_attention(", "_prefill_attention_v2("),
            [f"{IMPL}._prefill_attention"],
        ),
        (
            ("        return query\n\n", "        '''Just a docstring.'''\n\n"),
            [f"a body in {IMPL}._prefill"],
        ),
        (
            ("_CONTINUATION_DECODE_THRESHOLD = 128", "_tq_chunked_prefill = None"),
            ["already bound: _tq_chunked_prefill"],
        ),
    ],
)
def test_an_unexpected_shape_is_refused_naming_it_and_nothing_is_written(
    tmp_path, mutation, named
):
    assert mutation[0] in SHAPE
    _tree(tmp_path, SHAPE.replace(*mutation))
    before = _snapshot(tmp_path)
    rc, out, err = _run(tmp_path)
    assert rc == 1 and out == ""
    assert (
        "turboquant_attn.py does not have the expected shape; not found: " in err
        and "nothing written" in err
    )
    for n in named:
        assert n in err
    assert _snapshot(tmp_path) == before


def test_every_missing_part_is_named_at_once(tmp_path):
    text = SHAPE.replace("class TurboQuantMetadataBuilder:", "class B:").replace(
        "def _continuation_prefill(self, layer,", "def _continuation_prefill(self,"
    )
    _tree(tmp_path, text)
    rc, _, err = _run(tmp_path)
    assert (
        rc == 1
        and "class TurboQuantMetadataBuilder" in err
        and "._continuation_prefill(" in err
    )


RESERVE_PAIR = (
    "    def _reserve_workspace(self):\n"
    "        current_workspace_manager().get_simultaneous(((4,), torch.float32))\n"
    "\n"
    "        # the continuation pair\n"
    "        shape = (1, 2, self.max_model_len, 64)\n"
    "        current_workspace_manager().get_simultaneous(\n"
    "            (shape, torch.float16), (shape, torch.float16)\n"
    "        )\n"
    "\n    def build("
)


def test_a_reservation_without_the_pair_is_refused(tmp_path):
    reserve = RESERVE_PAIR.replace("torch.float16", "torch.bfloat16")
    _tree(tmp_path, SHAPE.replace("    def build(", reserve, 1))
    rc, _, err = _run(tmp_path)
    assert rc == 1
    assert f"in {BUILDER}._reserve_workspace: the decode get_simultaneous" in err
    assert not (tmp_path / VENDORED_DIR).exists()


def test_the_pair_is_reserved_only_after_tq_chunked_declines(tmp_path):
    path = _tree(tmp_path, SHAPE.replace("    def build(", RESERVE_PAIR, 1))
    rc, out, err = _run(tmp_path)
    assert rc == 0, err
    fn = _parts(ast.parse(path.read_text()))[f"{BUILDER}._reserve_workspace"]
    assert [ast.unparse(s) for s in fn.body] == [
        "current_workspace_manager().get_simultaneous(((4,), torch.float32))",
        f"if {RESERVE}:\n    return",
        "shape = (1, 2, self.max_model_len, 64)",
        (
            "current_workspace_manager().get_simultaneous((shape, torch.float16), "
            "(shape, torch.float16))"
        ),
    ]
    assert f"+        if {RESERVE}:\n+            return\n" in out
    assert "-        # the continuation pair\n" not in out  # kept
    # Where the builder has _reserve_workspace, __init__ is left alone.
    init = _parts(ast.parse(path.read_text()))[f"{BUILDER}.__init__"]
    assert init.body[-1].targets[0].attr == "kv_cache_spec"


def test_check_writes_nothing_and_a_second_run_has_nothing_to_do(tmp_path):
    path = _tree(tmp_path, SHAPE)
    before = _snapshot(tmp_path)
    rc, out, _ = _run(tmp_path, "--check")
    assert rc == 0 and out.startswith(
        f"--- a/{TARGET.as_posix()}\n+++ b/{TARGET.as_posix()}\n"
    )
    assert (
        f"would add {VENDORED_DIR.as_posix()}/ ({len(RUNTIME_MODULES)} files" in out
        and "nothing written" in out
    )
    assert "no tests/quantization/ in this tree" in out
    assert _snapshot(tmp_path) == before
    rc, out2, _ = _run(tmp_path)
    diff = out.split("would add")[0]
    assert (
        rc == 0
        and out2.startswith(diff)
        and f"\nadded {VENDORED_DIR.as_posix()}/ ({len(RUNTIME_MODULES)} files" in out2
    )
    vendored = _snapshot(tmp_path)
    assert vendored[TARGET.as_posix()] != before[TARGET.as_posix()]
    assert {
        k.rsplit("/", 1)[1] for k in vendored if k.startswith(VENDORED_DIR.as_posix())
    } == RUNTIME_MODULES
    compile(path.read_text(), str(path), "exec")
    rc, out3, _ = _run(tmp_path)
    assert rc == 0 and "nothing to do" in out3 and _snapshot(tmp_path) == vendored
    # A vendored tree from another tq_chunked (here: one edited file) is refused.
    (tmp_path / VENDORED_DIR / "plan.py").write_text("# edited\n")
    edited = _snapshot(tmp_path)
    rc, _, err = _run(tmp_path)
    assert rc == 1 and "is not what tq_chunked" in err and _snapshot(tmp_path) == edited


@pytest.mark.parametrize("tests", [VLLM_TEST_SHAPE, ""], ids=["0.24-on", "0.20-0.23"])
def test_in_a_checkout_vllms_tests_are_edited_and_one_added(tmp_path, tests):
    """A tree with vLLM's tests/quantization/: the reservation tests (where there are
    any) rewritten from tq_chunked/upstream_tests/turboquant_reservation.py, every other
    line of the file kept; the new test added; the same on a second run: nothing."""
    _tree(tmp_path, SHAPE, tests=tests)
    before = _snapshot(tmp_path)
    rc, out, err = _run(tmp_path, "--check")
    assert rc == 0, err
    assert _snapshot(tmp_path) == before
    assert f"would add {NEW_TEST.as_posix()}" in out
    rc, out, err = _run(tmp_path)
    assert rc == 0, err
    added = (tmp_path / NEW_TEST).read_text()
    assert added == vendor.new_test_text()
    assert added.startswith("# SPDX-License-Identifier: Apache-2.0\n")
    template = (
        ROOT / "tq_chunked" / "upstream_tests" / "test_turboquant_chunked_prefill.py"
    ).read_text()
    assert added.endswith(template.split('"""', 1)[1]) and "Vendored from" in added
    if tests:
        assert f"--- a/{VLLM_TEST.as_posix()}" in out
        edited = ast.parse((tmp_path / VLLM_TEST).read_text())
        ours = ast.parse(
            (
                ROOT / "tq_chunked" / "upstream_tests" / "turboquant_reservation.py"
            ).read_text()
        )
        theirs = ast.parse(tests)

        def methods(tree):
            return {
                f"{c.name}.{f.name}": ast.dump(f)
                for c in tree.body
                if isinstance(c, ast.ClassDef)
                for f in c.body
                if isinstance(f, ast.FunctionDef)
            }

        new, old, template_methods = methods(edited), methods(theirs), methods(ours)
        assert new.keys() == old.keys()
        for key in new:
            assert new[key] == template_methods.get(key, old[key])
        assert template_methods.keys() < new.keys()
    else:
        assert not (tmp_path / VLLM_TEST).exists()
    after = _snapshot(tmp_path)
    rc, out, _ = _run(tmp_path)
    assert rc == 0 and "nothing to do" in out and _snapshot(tmp_path) == after


def test_a_package_directory_left_without_the_edit_is_refused(tmp_path):
    _tree(tmp_path, SHAPE)
    (tmp_path / VENDORED_DIR).mkdir()
    rc, _, err = _run(tmp_path)
    assert rc == 1 and "exists but" in err
    assert (tmp_path / TARGET).read_text() == SHAPE


def test_a_directory_without_vllm_is_refused(tmp_path):
    rc, _, err = _run(tmp_path)
    assert rc == 1 and "VLLM_SOURCE_DIR must contain the vllm/ package" in err


# --- the vendored vLLM runs the plugin tests ----------------------------------------


def _selected(python):
    if HAS_VLLM:
        return True
    chosen = os.environ.get("TQ_CHUNKED_VENDOR_ENVS", "")
    name = Path(python).parents[1].name
    return chosen == "all" or name in (chosen.split(",") if chosen else CI_ENVS)


def vendor_into_a_farm(python, dest, tests_dir=None):
    """A symlink farm of ``python``'s vLLM install at ``dest`` (with a copy of
    ``tests_dir`` as its tests/), vendored by ``python -m tq_chunked.vendor`` run by
    that Python. Returns (the farm, the tool's stdout)."""
    install = vllm_dir(python)
    tree = symlink_farm(install, dest, tests_dir)
    r = subprocess.run(
        [python, "-m", "tq_chunked.vendor", str(tree)],
        cwd=ROOT,
        env=cpu_test_env(str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"--- a/{TARGET.as_posix()}")
    assert f"added {VENDORED_DIR.as_posix()}/" in r.stdout
    # The install is untouched.
    assert not (install / VENDORED_DIR.relative_to("vllm")).exists()
    return tree, r.stdout


@pytest.mark.parametrize("python", _pythons())
def test_vendored_vllm_passes_the_plugin_tests_with_the_plugin_off(python, tmp_path):
    _needs(python)
    if not _selected(python):
        pytest.skip(
            f"CI vendors {', '.join(CI_ENVS)}; TQ_CHUNKED_VENDOR_ENVS=all (or a list "
            "of names) for more"
        )
    t0 = time.perf_counter()
    tree, _ = vendor_into_a_farm(python, tmp_path)
    t_vendor = time.perf_counter() - t0
    env = cpu_test_env(
        str(ROOT),
        PYTHONPATH=str(tree),
        TQ_CHUNKED_DISABLE="1",
        TQ_CHUNKED_VENDORED=str(tree),
        TQ_CHUNKED_WINDOW=WINDOW,
        # No bytecode written into the install through the links.
        PYTHONDONTWRITEBYTECODE="1",
    )
    r = subprocess.run(
        [
            python,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            str(ROOT / "tests" / "test_vllm_plugin.py"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    t_tests = time.perf_counter() - t0 - t_vendor
    print(f"vendor: {t_vendor:.1f}s; plugin tests on the vendored tree: {t_tests:.1f}s")
    print(r.stdout[-4000:], r.stderr[-2000:])
    assert r.returncode == 0, "the plugin tests failed on the vendored vLLM"
    passed = {
        line.split("::", 1)[1]
        for line in r.stdout.splitlines()
        if line.startswith("PASSED ")
    }
    # The tests of the answers ran, not skipped.
    for preset in ("turboquant_3bit_nc", "turboquant_k8v4"):
        for test in (
            "test_prefix_hits_beside_a_longer_first_chunk_keep_their_prefix",
            "test_a_locked_workspace_holds_the_patched_prefill_through_the_builder_hook",
        ):
            assert f"{test}[{preset}]" in passed


@pytest.mark.parametrize("flags", [(), ("--check",)], ids=["write", "check"])
def test_a_tree_the_tool_cannot_vendor_is_refused_in_one_line(tmp_path, flags):
    """Refused the same way with --check as without, before anything is printed or
    written: a turboquant_attn.py that does not parse, a tree without
    vllm/v1/attention/ops/ (where the package goes), a test_turboquant.py that does
    not parse."""
    cases = {
        "unparsable": (SHAPE + "def broken(:\n", None, True),
        "no-ops-dir": (SHAPE, None, False),
        "unparsable-test": (SHAPE, "class Broken(\n", True),
    }
    expected = {
        "unparsable": f"{TARGET.as_posix()} does not parse as Python (line "
        f"{len(SHAPE.splitlines()) + 1}: invalid syntax)",
        "no-ops-dir": "vllm/v1/attention/ops is not a directory: the vllm/ package",
        "unparsable-test": f"{VLLM_TEST.as_posix()} does not parse as Python",
    }
    for name, (text, tests, ops_dir) in cases.items():
        root = tmp_path / name
        _tree(root, text, tests=tests)
        if not ops_dir:
            (root / VENDORED_DIR.parent).rmdir()
        before = _snapshot(root)
        rc, out, err = _run(root, *flags)
        assert rc == 1 and out == "", (name, out)
        assert err.startswith("tq_chunked.vendor: ") and err.count("\n") == 1, err
        assert expected[name] in err and err.endswith("; nothing written\n"), err
        assert _snapshot(root) == before


# vLLM's .buildkite/test_areas/quantization.yaml in the shape of 0.34.0: steps last, at
# column 0, some commented out.
CI_SHAPE = """\
group: Quantization
depends_on:
  - image-build
steps:
# Disabled until later.
# - label: ":nvidia: Quantization"
#   key: quantization

- label: ":nvidia: Quantized Fusions"
  key: quantized-fusions
  commands:
    - pytest -v -s fusion/
"""


def test_in_a_checkout_the_added_test_gets_a_buildkite_job(tmp_path):
    """With vLLM's quantization pipeline in the tree, one job is appended to its steps
    (the rest of the file as it was), naming the added test in its commands; the diff is
    printed; a second run has nothing to do. Without .buildkite/, a note says the test
    is wired into no job."""
    _tree(tmp_path, SHAPE, tests="")
    (tmp_path / CI_JOBS).parent.mkdir(parents=True)
    (tmp_path / CI_JOBS).write_text(CI_SHAPE)
    rc, out, err = _run(tmp_path)
    assert rc == 0, err
    new = (tmp_path / CI_JOBS).read_text()
    assert new.startswith(CI_SHAPE + "\n- label: ")
    step = new[len(CI_SHAPE) + 1 :]
    assert f"  key: {CI_KEY}\n" in step
    assert "  commands:\n  - pytest -v -s quantization/" + NEW_TEST.name in step
    assert f"  - {VENDORED_DIR.as_posix()}/\n" in step
    assert f"--- a/{CI_JOBS.as_posix()}" in out and "no .buildkite" not in out
    after = _snapshot(tmp_path)
    rc, out, _ = _run(tmp_path)
    assert rc == 0 and "nothing to do" in out and _snapshot(tmp_path) == after
    # The job taken out again: the tree is not what this tq_chunked writes.
    (tmp_path / CI_JOBS).write_text(CI_SHAPE)
    rc, _, err = _run(tmp_path)
    assert rc == 1 and "is not what tq_chunked" in err and CI_JOBS.as_posix() in err
    # No pipelines: said so.
    other = tmp_path / "other"
    _tree(other, SHAPE, tests="")
    rc, out, _ = _run(other)
    assert rc == 0 and f"note: no {CI_JOBS.as_posix()} in this tree" in out


def test_the_vendored_folder_has_mkdirs_mode(tmp_path):
    """0755 under the usual umask (022), as mkdir makes it; the files 0644: readable by
    every user of the tree (it is written in a private temporary folder first)."""
    _tree(tmp_path, SHAPE)
    old = os.umask(0o022)
    try:
        rc, _, err = _run(tmp_path)
    finally:
        os.umask(old)
    assert rc == 0, err
    assert (tmp_path / VENDORED_DIR).stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / VENDORED_DIR).iterdir()} == {
        0o644
    }
