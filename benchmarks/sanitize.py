"""Each kernel once at small shapes, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize.py

The shapes exercise every mask: head sizes that are not a power of two, long requests
cut into windows, a block id outside the cache (its request comes out NaN), empty
requests, strided inputs, the un-rotation on tensor cores and the merges.
"""

import torch

from tq_chunked import continuation_prefill_varlen
from tq_chunked.tools.testing import build_batch


def main():
    for preset, d, dtype, backend in [
        ("turboquant_3bit_nc", 128, torch.float16, "triton"),
        ("turboquant_k8v4", 80, torch.bfloat16, "triton"),
        ("turboquant_4bit_nc", 64, torch.bfloat16, "triton"),
    ]:
        b = build_batch(
            preset,
            [(70, 20), (0, 9), (33, 0), (50, 3)],
            4,
            2,
            d,
            16,
            dtype,
            "cuda",
            seed=d,
        )
        b["block_table"][3, 1] = (
            b["kv_cache"].shape[0] + 5
        )  # outside the cache: never read, request 3 NaN
        q = (
            b["query"].transpose(0, 1).contiguous().transpose(0, 1)
        )  # token stride Hq * D, strided heads
        out = continuation_prefill_varlen(
            q,
            b["key"],
            b["value"],
            b["kv_cache"],
            b["block_table"],
            None,
            None,
            **b["kwargs"],
            query_start_loc_cpu=b["query_start_loc"],
            seq_lens_cpu=b["seq_lens"],
            window=40,
            backend=backend,
            check_block_table=False,
            return_lse=True,
        )[0]
        torch.cuda.synchronize()
        rows = slice(b["query_start_loc"][3], b["query_start_loc"][4])
        ok = out[rows].isnan().all() and torch.isfinite(out[: rows.start]).all()
        print(
            preset,
            d,
            dtype,
            backend,
            "as expected" if ok else "UNEXPECTED non-finite pattern",
        )


if __name__ == "__main__":
    main()
