"""Real vLLM TurboQuant objects outside an engine, for the GPU tests and the
benchmark, and the places the CPU tests run vLLM in (``cpu_test_env``,
``symlink_farm``).

Builds vLLM's own ``TurboQuantAttentionImpl`` and a layer carrying the buffers vLLM
derives (centroids, Pi), fills a paged cache with vLLM's own store kernel, and exposes
vLLM's decode kernel and ``_continuation_prefill`` as installed (another release's
methods: ``tq_chunked.tools.baseline``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def vllm_available() -> bool:
    try:
        import vllm.v1.attention.backends.turboquant_attn  # noqa: F401

        return True
    except Exception:
        return False


@dataclass
class VllmTQ:
    impl: object
    layer: torch.nn.Module

    @property
    def rotation(self):
        return self.layer._tq_Pi

    @property
    def centroids(self):
        return self.layer._tq_centroids


def build_vllm_tq(
    preset: str, num_q_heads: int, num_kv_heads: int, head_dim: int, device="cuda"
) -> VllmTQ:
    """The impl vLLM builds for ``preset`` inside a default VllmConfig, and its
    layer."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionImpl

    with set_current_vllm_config(VllmConfig()):
        impl = TurboQuantAttentionImpl(
            num_heads=num_q_heads,
            head_size=head_dim,
            scale=head_dim**-0.5,
            num_kv_heads=num_kv_heads,
            kv_cache_dtype=preset,
        )
    layer = torch.nn.Module()
    layer._tq_centroids = get_centroids(head_dim, impl.tq_config.centroid_bits).to(
        device
    )
    impl._ensure_on_device(layer, torch.device(device))
    return VllmTQ(impl, layer)


def vllm_store(tq: VllmTQ, key, value, kv_cache, slot_mapping) -> None:
    """Write key/value (N, Hk, D) into kv_cache with vLLM's own store kernel."""
    tq.impl.do_kv_cache_update(tq.layer, key, value, kv_cache, slot_mapping)


def vllm_decode(tq: VllmTQ, rotation, centroids, scale: float, head_dim: int, device):
    """The installed vLLM's TurboQuant decode kernel
    (``triton_turboquant_decode_attention``) as its ``_decode_attention`` calls it:
    the layer's decode buffers (allocated by the kernel on its first call) and the
    impl's split count. Returns ``f(query, kv_cache, block_table, seq_lens)``; the
    rotation (None: the identity), its transpose and the centroids in float32 are made
    once here, not per call."""
    from vllm.v1.attention.ops.triton_turboquant_decode import (
        triton_turboquant_decode_attention,
    )

    impl, layer = tq.impl, tq.layer
    cfg = impl.tq_config
    pi = (
        rotation if rotation is not None else torch.eye(head_dim, device=device)
    ).float()
    pi_t = pi.T.contiguous()
    centroids = centroids.float()

    def call(query, kv_cache, block_table, seq_lens):
        return triton_turboquant_decode_attention(
            query=query,
            kv_cache=kv_cache,
            block_table=block_table,
            seq_lens=seq_lens,
            Pi=pi,
            centroids=centroids,
            scale=scale,
            mse_bits=cfg.key_mse_bits,
            key_packed_size=cfg.key_packed_size,
            value_quant_bits=cfg.effective_value_quant_bits,
            key_fp8=cfg.key_fp8,
            norm_correction=cfg.norm_correction,
            PiT=pi_t,
            mid_o_buf=getattr(layer, "_tq_mid_o_buf", None),
            output_buf=getattr(layer, "_tq_output_buf", None),
            lse_buf=getattr(layer, "_tq_lse_buf", None),
            buf_holder=layer,
            max_num_kv_splits=impl.max_num_kv_splits,
        )

    return call


def vllm_continuation_prefill(
    tq: VllmTQ, query, key_chunk, val_chunk, kv_cache, block_table, cached_len
):
    """The installed vLLM's own ``_continuation_prefill``."""
    return tq.impl._continuation_prefill(
        tq.layer,
        query,
        key_chunk,
        val_chunk,
        kv_cache,
        block_table.reshape(1, -1),
        cached_len,
        cached_len + query.shape[0],
        tq.rotation,
        tq.centroids,
    )


def cpu_test_env(root: str, **extra: str) -> dict[str, str]:
    """The environment in which this project's tests run vLLM on a CPU (inside the
    ``.vllm-envs/`` installs): this checkout (``root``) importable, vLLM's and this
    project's Triton kernels in Triton's interpreter, and ``CUDA_VISIBLE_DEVICES``
    empty, under which vLLM hands its modules the real Triton (without a GPU driver it
    hands them a placeholder, under which UltraQuant's module cannot be imported);
    neither the plugin's switches (off, window, FA2 kept) nor the vendored tests'
    marker is inherited. ``extra`` is added last."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(
        [p for p in (extra.pop("PYTHONPATH", ""), root) if p]
    )
    for name in (
        "TQ_CHUNKED_DISABLE",
        "TQ_CHUNKED_VENDORED",
        "TQ_CHUNKED_WINDOW",
        "TQ_CHUNKED_PATH",
        "TQ_CHUNKED_KEEP_FA2",
    ):
        env.pop(name, None)
    env.update(extra)
    return env


def symlink_farm(vllm_dir, dest, tests_dir=None):
    """``dest/vllm``: a vLLM tree to vendor into without copying the installed package
    ``vllm_dir`` (about 0.9 GB): symlinks to its entries, except along the paths the
    vendor tool writes (real directories, and a real copy of turboquant_attn.py), so
    the tool never writes into the install. With ``tests_dir`` (vLLM's ``tests/`` from
    a source distribution), ``dest/tests`` is a real copy of it, as in a checkout.
    Returns ``dest``."""
    import shutil
    from pathlib import Path

    vllm_dir, dest = Path(vllm_dir).resolve(), Path(dest)
    real_dirs = {
        Path("."),
        Path("v1"),
        Path("v1/attention"),
        Path("v1/attention/backends"),
        Path("v1/attention/ops"),
    }
    target = Path("v1/attention/backends/turboquant_attn.py")
    for rel in sorted(real_dirs):
        (dest / "vllm" / rel).mkdir(parents=True, exist_ok=True)
        for entry in (vllm_dir / rel).iterdir():
            sub = rel / entry.name
            if entry.name == "__pycache__" or sub in real_dirs:
                continue
            if sub == target:
                shutil.copyfile(entry, dest / "vllm" / sub)
            else:
                os.symlink(entry, dest / "vllm" / sub)
    if tests_dir is not None:
        shutil.copytree(tests_dir, dest / "tests")
    return dest


def _version_key(name: str) -> tuple:
    """``vllm-0.34.0`` -> (0, 34, 0), for ordering releases."""
    return tuple(
        int(p) if p.isdigit() else p for p in name.split("-", 1)[-1].split(".")
    )


def vllm_envs(root) -> dict[str, str]:
    """{name: python} of the vLLM environments ``tests/install_vllm_cpu.sh`` built in
    ``root/.vllm-envs``, oldest release first: those it completed, which have the
    release's sources in ``src/`` (fetched after the environment passed its import
    check). One it did not complete (a build killed before it could remove it) is left
    out (``half_built_vllm_envs``)."""
    from pathlib import Path

    found = {}
    for python in Path(root, ".vllm-envs").glob("*/bin/python"):
        env = python.parents[1]
        if (env / "src" / "pyproject.toml").is_file():
            found[env.name] = str(python)
    return dict(sorted(found.items(), key=lambda item: _version_key(item[0])))


def half_built_vllm_envs(root) -> list[str]:
    """The names of the environments in ``root/.vllm-envs`` with a Python but without
    the sources ``tests/install_vllm_cpu.sh`` fetches last: builds it did not
    complete."""
    from pathlib import Path

    complete = vllm_envs(root)
    return sorted(
        p.parents[1].name
        for p in Path(root, ".vllm-envs").glob("*/bin/python")
        if p.parents[1].name not in complete
    )
