# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The two methods of ``TestTurboQuantWorkspaceReservation`` in vLLM's
``tests/quantization/test_turboquant.py`` (vLLM 0.24 onwards; checked against 0.33.0)
that assert the (1, Hk, max_model_len, D) continuation pair, as the vendored change
rewrites them: the vendor tool puts each method in place of vLLM's method of the same
name, in vLLM's class, whose ``_fake_vllm_config`` and ``_fake_kv_cache_spec`` they use.
"""

import torch


class TestTurboQuantWorkspaceReservation:
    def test_metadata_builder_reserves_decode_and_continuation_prefill_workspace(
        self, monkeypatch
    ):
        from vllm.v1.attention.backends import turboquant_attn
        from vllm.v1.attention.ops.tq_chunked import default_window, workspace_bytes

        calls = []

        class FakeWorkspaceManager:
            def get_simultaneous(self, *shapes_and_dtypes):
                calls.append(shapes_and_dtypes)

        monkeypatch.setattr(
            turboquant_attn,
            "current_workspace_manager",
            lambda: FakeWorkspaceManager(),
        )
        monkeypatch.setattr(
            turboquant_attn,
            "is_workspace_manager_initialized",
            lambda: True,
        )
        # The default window, whatever TQ_CHUNKED_WINDOW says.
        monkeypatch.setattr(turboquant_attn._tq_chunked_prefill, "window", None)

        turboquant_attn.TurboQuantMetadataBuilder(
            kv_cache_spec=self._fake_kv_cache_spec(),
            layer_names=["layers.0.self_attn.attn"],
            vllm_config=self._fake_vllm_config(),
            device=torch.device("cuda"),
        )

        # Continuation prefill reads the cached prefix in windows of one workspace,
        # sized for max_num_batched_tokens query tokens (4096; 8 query and 4 KV heads
        # of size 128, block size 32, fp16) whatever max_model_len is: it is reserved
        # in place of the (1, 4, 8192, 128) fp16 K/V pair.
        window = default_window(4, 128, 32)
        prefill_workspace = workspace_bytes(4096, 8, 4, 128, window, torch.float16)
        assert calls == [
            (
                ((16, 8, 4, 129), torch.float32),
                ((16, 8, 128), torch.float16),
                ((16, 8), torch.float32),
            ),
            (((prefill_workspace,), torch.uint8),),
        ]

    def test_metadata_builder_skips_continuation_prefill_when_disabled(
        self, monkeypatch
    ):
        from vllm.v1.attention.backends import turboquant_attn
        from vllm.v1.attention.ops.tq_chunked import default_window, workspace_bytes

        calls = []

        class FakeWorkspaceManager:
            def get_simultaneous(self, *shapes_and_dtypes):
                calls.append(shapes_and_dtypes)

        monkeypatch.setattr(
            turboquant_attn,
            "current_workspace_manager",
            lambda: FakeWorkspaceManager(),
        )
        monkeypatch.setattr(
            turboquant_attn,
            "is_workspace_manager_initialized",
            lambda: True,
        )
        monkeypatch.setattr(turboquant_attn._tq_chunked_prefill, "window", None)

        turboquant_attn.TurboQuantMetadataBuilder(
            kv_cache_spec=self._fake_kv_cache_spec(),
            layer_names=["layers.0.self_attn.attn"],
            vllm_config=self._fake_vllm_config(enable_chunked_prefill=False),
            device=torch.device("cuda"),
        )

        # Without chunked prefill there is no K/V pair, but prefill still reads
        # cached prefixes (prefix-cache hits) through the windowed workspace.
        window = default_window(4, 128, 32)
        prefill_workspace = workspace_bytes(4096, 8, 4, 128, window, torch.float16)
        assert calls == [
            (
                ((16, 8, 4, 129), torch.float32),
                ((16, 8, 128), torch.float16),
                ((16, 8), torch.float32),
            ),
            (((prefill_workspace,), torch.uint8),),
        ]
