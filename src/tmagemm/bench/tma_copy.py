"""TMA throughput and host-cost measurements: copy/elementwise GB/s across swizzle modes and box
shapes next to ``torch`` copy and the device's copy roofline; NVRTC compile vs cache-hit time;
tensor-map encode vs address replacement; launch host overhead vs ``torch._scaled_mm``.

``python -m tmagemm.bench.tma_copy --json out.json`` runs everything and prints tables.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import tempfile
import time
from typing import Callable, Sequence

import torch

from tmagemm import jit, tma
from tmagemm.bench.timing import Timer, copy_bandwidth_gbs
from tmagemm.cuda import tma_copy
from tmagemm.cuda.tma_copy import CopyConfig, ElementwiseConfig

# Box shapes per swizzle, as (rows, inner bytes); the inner extent never exceeds the span.
DEFAULT_COPY_BOXES: dict[str, Sequence[tuple[int, int]]] = {
    "none": ((64, 128), (128, 256), (256, 64)),
    "32B": ((128, 32), (256, 32)),
    "64B": ((64, 64), (128, 64), (256, 64)),
    "128B": ((32, 128), (64, 128), (128, 128), (256, 128)),
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def run_tma_copy_bench(
    *,
    shape: tuple[int, int] = (8192, 8192),
    dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
    boxes: dict[str, Sequence[tuple[int, int]]] | None = None,
    stages: Sequence[int] = (4,),
    elementwise: bool = True,
    device: torch.device | None = None,
) -> list[dict]:
    """One row per (kind, dtype, swizzle, box, stages): GB/s (bytes read + written per second,
    median with L2 flushed), torch copy GB/s of the same tensors, % of the measured D2D copy
    roofline; every result is checked against the input before it is reported."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    timer = Timer(device)
    roofline = copy_bandwidth_gbs(device)
    rows_out: list[dict] = []
    for dtype in dtypes:
        x = (torch.randn(shape, device=device) * 8).to(dtype)
        out = torch.empty_like(x)
        moved = 2 * x.numel() * x.element_size()
        torch_us = timer.eager(lambda: out.copy_(x)).median_us
        torch_gbps = moved / (torch_us * 1e-6) / 1e9
        size = x.element_size()
        for swizzle, box_list in (boxes or DEFAULT_COPY_BOXES).items():
            for box_rows, inner_bytes in box_list:
                box_cols = inner_bytes // size
                for n_stages in stages:
                    config = CopyConfig(box_rows, box_cols, swizzle, n_stages)
                    if n_stages * config.stage_bytes(size) + 1024 > tma_copy.MAX_SMEM_BYTES:
                        continue
                    out.zero_()
                    tma_copy.copy_2d(x, out, config)
                    torch.cuda.synchronize(device)
                    if not torch.equal(out.view(torch.uint8), x.view(torch.uint8)):
                        raise AssertionError(f"TMA copy mismatch for {config}")
                    us = timer.eager(lambda: tma_copy.copy_2d(x, out, config)).median_us
                    gbps = moved / (us * 1e-6) / 1e9
                    rows_out.append(_row("copy", dtype, shape, swizzle, (box_rows, box_cols), n_stages, us, gbps,
                                         torch_gbps, roofline))  # fmt: skip
                if elementwise and dtype in (torch.bfloat16, torch.float32, torch.int32, torch.float8_e4m3fn):
                    config = ElementwiseConfig(box_rows, box_cols, swizzle)
                    tma_copy.elementwise_2d(x, out, config)
                    torch.cuda.synchronize(device)
                    expected = (2 * x.double() - 1).to(dtype) if dtype != torch.int32 else 2 * x - 1
                    if not torch.equal(out.view(torch.uint8), expected.view(torch.uint8)):
                        raise AssertionError(f"TMA elementwise mismatch for {config}")
                    us = timer.eager(lambda: tma_copy.elementwise_2d(x, out, config)).median_us
                    gbps = moved / (us * 1e-6) / 1e9
                    rows_out.append(_row("elementwise", dtype, shape, swizzle, (box_rows, box_cols), 1, us, gbps,
                                         torch_gbps, roofline))  # fmt: skip
    return rows_out


def _row(kind, dtype, shape, swizzle, box, stages, us, gbps, torch_gbps, roofline) -> dict:
    return {
        "kind": kind,
        "dtype": _dtype_name(dtype),
        "shape": list(shape),
        "swizzle": swizzle,
        "box": list(box),
        "stages": stages,
        "us": round(us, 2),
        "gbps": round(gbps, 1),
        "torch_gbps": round(torch_gbps, 1),
        "vs_torch": round(gbps / torch_gbps, 3),
        "roofline_gbps": round(roofline, 1),
        "pct_roofline": round(100 * gbps / roofline, 1),
    }


def _host_us(fn: Callable[[], object], calls: int) -> float:
    """Median over 5 trials of per-call host time for ``calls`` back-to-back calls, no sync inside
    the timed region (kept short so the launch queue never fills)."""
    fn()
    torch.cuda.synchronize()
    trials = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        trials.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(trials)


def measure_host_costs(calls: int = 100) -> dict:
    """Launch overhead (full host path: two cached maps + launch, and the bare launch) next to
    torch._scaled_mm at M=16, N=K=4096; tensor-map encode vs replace; compile miss vs hit."""
    device = torch.device("cuda", torch.cuda.current_device())
    m, n, k = 16, 4096, 4096
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones(1, device=device)
    scaled_mm_us = _host_us(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), calls)

    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    y = torch.empty_like(x)
    config = CopyConfig(16, 64, "128B", 2)
    tma_copy.copy_2d(x, y, config)
    kernel = jit.compile(tma_copy.SOURCE, defines=tma_copy.copy_defines(2, config)).function("tma_copy_2d")
    cache = tma.TensorMapCache()
    tiles_cols, tiles = k // 64, k // 64
    smem = 2 * config.stage_bytes(2) + 1024

    def ours() -> None:
        kernel.launch(132, 32, (cache.get(x, (16, 64)), cache.get(y, (16, 64)), ctypes.c_int32(tiles_cols),
                                ctypes.c_int32(tiles)), smem_bytes=smem)  # fmt: skip

    in_map, out_map = tma.make_tensor_map(x, (16, 64)), tma.make_tensor_map(y, (16, 64))
    args = (in_map, out_map, ctypes.c_int32(tiles_cols), ctypes.c_int32(tiles))
    launch_us = _host_us(lambda: kernel.launch(132, 32, args, smem_bytes=smem), calls)
    full_us = _host_us(ours, calls)
    torch.cuda.synchronize()
    if not torch.equal(y, x):
        raise AssertionError("copy launched by the overhead loop is wrong")

    encode_us = _host_us(lambda: tma.make_tensor_map(x, (16, 64)), calls)
    other = torch.empty_like(x)
    flip = [x.data_ptr(), other.data_ptr()]
    state = {"i": 0}

    def replace() -> None:
        state["i"] ^= 1
        in_map.replace_address(flip[state["i"]])

    replace_us = _host_us(replace, calls)

    with tempfile.TemporaryDirectory() as tmp:
        previous = os.environ.get("TMAGEMM_CACHE_DIR")
        os.environ["TMAGEMM_CACHE_DIR"] = tmp
        try:
            jit.clear_memory_cache()
            defines = tma_copy.elementwise_defines(torch.bfloat16, ElementwiseConfig(128, 64, "128B"))
            miss = jit.compile(tma_copy.SOURCE, defines=defines)
            jit.clear_memory_cache()
            hit = jit.compile(tma_copy.SOURCE, defines=defines)
            t0 = time.perf_counter()
            jit.compile(tma_copy.SOURCE, defines=defines)
            memory_hit_s = time.perf_counter() - t0
        finally:
            if previous is None:
                os.environ.pop("TMAGEMM_CACHE_DIR", None)
            else:
                os.environ["TMAGEMM_CACHE_DIR"] = previous
            jit.clear_memory_cache()
    return {
        "scaled_mm_host_us": round(scaled_mm_us, 2),
        "launch_host_us": round(launch_us, 2),
        "launch_with_map_cache_host_us": round(full_us, 2),
        "encode_us": round(encode_us, 2),
        "replace_address_us": round(replace_us, 2),
        "compile_miss_ms": round(miss.compile_seconds * 1e3, 1),
        "compile_disk_hit_ms": round(hit.compile_seconds * 1e3, 2),
        "compile_memory_hit_us": round(memory_hit_s * 1e6, 1),
        "disk_hit": hit.cache_hit and not miss.cache_hit,
    }


def _print_table(rows: list[dict]) -> None:
    print(f"{'kind':<12}{'dtype':<10}{'swizzle':<8}{'box':<12}{'st':>3}{'us':>10}{'GB/s':>9}{'torch':>9}{'vs torch':>9}{'%roof':>7}")
    for r in rows:
        box = "x".join(map(str, r["box"]))
        print(f"{r['kind']:<12}{r['dtype']:<10}{r['swizzle']:<8}{box:<12}{r['stages']:>3}{r['us']:>10.1f}"
              f"{r['gbps']:>9.0f}{r['torch_gbps']:>9.0f}{r['vs_torch']:>9.3f}{r['pct_roofline']:>7.1f}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write rows and host costs with metadata here")
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--stages", type=int, nargs="+", default=[4])
    args = parser.parse_args(argv)
    from tmagemm.bench import envinfo

    rows = run_tma_copy_bench(shape=(args.size, args.size), stages=args.stages)
    host = measure_host_costs()
    _print_table(rows)
    print(json.dumps(host, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"meta": envinfo.metadata("python -m tmagemm.bench.tma_copy"), "rows": rows, "host": host},
                      handle, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
