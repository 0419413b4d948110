"""TMA copy kernels: every variant compiles to TMA SASS without local memory (CPU); exact results,
ragged edges, padded strides, OOB fill and byte-exact swizzle layouts on the hardware (GPU)."""

import pytest
import torch

from tmagemm import jit, tma
from tmagemm.cuda import tma_copy
from tmagemm.cuda.tma_copy import CopyConfig, ElementwiseConfig

SWIZZLES = ["none", "32B", "64B", "128B"]
ELEM_DTYPES = [torch.int32, torch.float32, torch.bfloat16, torch.float8_e4m3fn]
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ------------------------------------------------------------------ CPU: compile + SASS


def _assert_tma_sass(module, kernel, *, store):
    sass = jit.sass(module.cubin)
    assert "UTMALDG" in sass
    assert ("UTMASTG" in sass) == store
    assert "LDL" not in sass and "STL" not in sass  # no local memory traffic
    usage = module.resource_usage(kernel)
    assert usage.local_bytes == 0 and usage.spill_stores == 0 and usage.spill_loads == 0


@pytest.mark.parametrize("swizzle", SWIZZLES)
@pytest.mark.parametrize("dtype", ELEM_DTYPES)
def test_elementwise_variants_compile_to_tma(dtype, swizzle):
    module = jit.compile(tma_copy.SOURCE, defines=tma_copy.elementwise_defines(dtype, ElementwiseConfig(swizzle=swizzle)))
    _assert_tma_sass(module, "tma_elementwise_2d", store=True)


@pytest.mark.parametrize("rank", [1, 2, 3, 4, 5])
def test_probe_variants_compile_to_tma(rank):
    module = jit.compile(tma_copy.SOURCE, defines={"PROBE_RANK": rank})
    _assert_tma_sass(module, "tma_probe", store=False)
    assert f"UTMALDG.{rank}D" in jit.sass(module.cubin)


@pytest.mark.parametrize("element_size", [1, 2, 4])
def test_copy_variant_compiles_to_tma(element_size):
    module = jit.compile(tma_copy.SOURCE, defines=tma_copy.copy_defines(element_size, CopyConfig()))
    _assert_tma_sass(module, "tma_copy_2d", store=True)


def test_store_extent_rule():
    # Measured on H100: a store to rows of 200 fp8 (200 B) also wrote columns 200..207.
    ok = tma.params_for_tensor(torch.zeros(4, 224, dtype=torch.float8_e4m3fn)[:, :208], (4, 128), swizzle="none")
    ok.validate_store()
    bad = tma.params_for_tensor(torch.zeros(4, 224, dtype=torch.float8_e4m3fn)[:, :200], (4, 128), swizzle="none")
    with pytest.raises(tma.TensorMapError, match="multiple of 16 bytes .* got 200\\*1 = 200"):
        bad.validate_store()


def test_probe_refuses_unaligned_inner_start():
    with pytest.raises(ValueError, match="starts at byte 300"):
        tma_copy.probe(torch.zeros(77, 200, dtype=torch.bfloat16), (16, 64), (70, 150), swizzle="128B")


def test_launchers_check_arguments():
    with pytest.raises(TypeError, match="supports"):
        tma_copy.elementwise_defines(torch.float16, ElementwiseConfig())
    with pytest.raises(ValueError, match="swizzle must be one of"):
        tma_copy.elementwise_defines(torch.float32, ElementwiseConfig(swizzle="16B"))
    with pytest.raises(ValueError, match="CUDA tensor"):
        tma_copy.elementwise_2d(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="2-D"):
        tma_copy.copy_2d(torch.zeros(4), torch.zeros(4))


# ------------------------------------------------------------------ GPU helpers


def _random(shape, dtype, device="cuda"):
    """Random values spanning the dtype (exactly representable; fp8 kept where 2x-1 stays finite)."""
    if dtype == torch.int32:
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device=device)
    if dtype == torch.float8_e4m3fn:
        return (torch.randn(shape, device=device) * 40).clamp(-200, 200).to(dtype)
    return (torch.randn(shape, device=device, dtype=torch.float32) * 100).to(dtype)


def _bits(x):
    return x.view(INT_VIEW[x.element_size()])


def _reference(x):
    if x.dtype == torch.int32:
        wide = 2 * x.long() - 1
        return ((wide + 2**31) % 2**32 - 2**31).to(torch.int32)
    return (2 * x.double() - 1).to(x.dtype)


def _padded(rows, cols, dtype, extra_rows=0, poison=0xEE):
    """A (rows, cols) view inside a larger poisoned buffer whose row stride is 16-byte aligned and
    wider than cols; returns (buffer, view)."""
    size = torch.empty((), dtype=dtype).element_size()
    align = 16 // size
    stride = (cols + align - 1) // align * align + align  # padded: never the tight stride
    buffer = torch.empty(rows + 2 * extra_rows, stride, dtype=dtype, device="cuda")
    buffer.view(torch.uint8).fill_(poison)
    return buffer, buffer[extra_rows : extra_rows + rows, :cols]


def _assert_untouched(buffer, before, inside):
    """Every element of ``buffer`` outside the ``inside`` window still holds its poison."""
    outside = torch.ones_like(before, dtype=torch.bool)
    outside[inside] = False
    changed = ((_bits(buffer) != before) & outside).nonzero()
    assert changed.numel() == 0, (
        f"TMA store wrote {changed.shape[0]} elements outside the tensor (row stride {buffer.stride(0)}, "
        f"window {inside}); first (row, col): {changed[:8].tolist()}; values {_bits(buffer)[tuple(changed[:8].t())].tolist()}"
    )


# ------------------------------------------------------------------ GPU: elementwise


@pytest.mark.gpu
@pytest.mark.parametrize("swizzle", SWIZZLES)
@pytest.mark.parametrize("dtype", ELEM_DTYPES)
# Column counts are ragged against every box width but keep rows a multiple of 16 bytes for all
# dtypes: TMA stores write whole 16-byte chunks at the row end (see test_store_extent_rule).
@pytest.mark.parametrize("rows, cols", [(1, 64), (17, 208), (727, 304)])
def test_elementwise_exact_with_ragged_edges_and_padded_strides(dtype, swizzle, rows, cols, seeded):
    src_buffer, x = _padded(rows, cols, dtype)
    x.copy_(_random((rows, cols), dtype))
    out_buffer, out = _padded(rows, cols, dtype, extra_rows=2)
    before = _bits(out_buffer).clone()
    tma_copy.elementwise_2d(x, out, ElementwiseConfig(box_rows=64, swizzle=swizzle))
    torch.cuda.synchronize()
    expected = _reference(x)
    mismatch = (_bits(out) != _bits(expected)).nonzero()
    assert mismatch.numel() == 0, f"first bad index {mismatch[0].tolist()}: {out[tuple(mismatch[0])]} vs {expected[tuple(mismatch[0])]}"
    _assert_untouched(out_buffer, before, (slice(2, 2 + rows), slice(0, cols)))


@pytest.mark.gpu
@pytest.mark.parametrize("box_rows, box_cols", [(256, 32), (8, 8), (3, 16)])
def test_elementwise_box_shapes(box_rows, box_cols, seeded):
    x = _random((300, 96), torch.float32)
    out = tma_copy.elementwise_2d(x, config=ElementwiseConfig(box_rows=box_rows, box_cols=box_cols, swizzle="128B"))
    torch.cuda.synchronize()
    assert torch.equal(out, _reference(x))


@pytest.mark.gpu
def test_elementwise_refuses_outputs_with_partial_16_byte_rows():
    x = torch.zeros(17, 224, dtype=torch.float8_e4m3fn, device="cuda")[:, :200]
    with pytest.raises(tma.TensorMapError, match="stores write whole 16-byte chunks"):
        tma_copy.elementwise_2d(x, torch.empty(17, 224, dtype=torch.float8_e4m3fn, device="cuda")[:, :200])


@pytest.mark.gpu
def test_elementwise_zero_size():
    x = torch.empty(0, 64, device="cuda")
    out = torch.full((0, 64), 3.0, device="cuda")
    assert tma_copy.elementwise_2d(x, out) is out


# ------------------------------------------------------------------ GPU: layout probe


def _expected_image(x, box_shape, coords, swizzle, region, *, element_strides=None, sentinel=0xA5):
    """Python model of one TMA load: gather the (strided) box with zero fill, pack it densely,
    swizzle the bytes with tma.swizzle_tile."""
    bits = _bits(x).cpu()
    steps = list(element_strides or [1] * x.dim())
    steps[-1] = 1  # the innermost element stride is ignored without interleave
    index, valid = [], []
    for dim, (start, box, step) in enumerate(zip(coords, box_shape, steps)):
        idx = torch.arange(start, start + box, step)
        valid.append((idx >= 0) & (idx < x.shape[dim]))
        index.append(idx.clamp(0, x.shape[dim] - 1))
    grids = torch.meshgrid(*index, indexing="ij")
    masks = torch.meshgrid(*valid, indexing="ij")
    inside = torch.stack(masks).all(dim=0)
    box = torch.where(inside, bits[grids], torch.zeros((), dtype=bits.dtype))
    dense = box.contiguous().view(torch.uint8).flatten()
    row_bytes = box.shape[-1] * x.element_size()
    return tma.smem_image(dense, row_bytes, swizzle, size=region, fill=sentinel), inside


def _probe_case(x, box_shape, coords, swizzle, **kw):
    image = tma_copy.probe(x, box_shape, coords, swizzle=swizzle, **kw).cpu()
    expected, _ = _expected_image(x, box_shape, coords, swizzle, image.numel(), element_strides=kw.get("element_strides"))
    diff = (image != expected).nonzero().flatten()
    assert diff.numel() == 0, (
        f"{diff.numel()} bytes differ, first at {diff[0].item()}: got {image[diff[0]].item():#x}, "
        f"reference {expected[diff[0]].item():#x}"
    )


def _bits_tensor(shape, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, device="cuda")
    return raw.view(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("swizzle", SWIZZLES)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("inner_fraction", [1, 2])  # inner box = span / fraction
def test_probe_matches_swizzle_reference(dtype, swizzle, inner_fraction, seeded):
    size = torch.empty((), dtype=dtype).element_size()
    span = tma.SWIZZLES[swizzle][1] or 128
    cols = span // inner_fraction // size
    if cols * size < 16:
        pytest.skip("inner box below 16 bytes")
    x = _bits_tensor((96, 160), dtype)
    for rows in (16, 5):
        _probe_case(x, (rows, cols), (8, 2 * cols), swizzle)


@pytest.mark.gpu
@pytest.mark.parametrize("swizzle", SWIZZLES)
def test_probe_out_of_bounds_zero_fill(swizzle, seeded):
    x = _bits_tensor((37, 56), torch.float16)[:, :50]  # 50 columns inside 112-byte rows
    cols = (tma.SWIZZLES[swizzle][1] or 64) // 2
    for coords in [(-3, -8), (30, 40), (36, 48), (-20, 8)]:  # inner starts 16-byte aligned
        _probe_case(x, (16, cols), coords, swizzle)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_probe_nan_fill(dtype, seeded):
    x = torch.randn(20, 24, device="cuda").to(dtype)
    cols = 16 // x.element_size() * 2
    image = tma_copy.probe(x, (8, cols), (16, 16), swizzle="none", oob_fill="nan").cpu()
    box = image[: 8 * cols * x.element_size()].view(dtype).reshape(8, cols)
    inside = torch.zeros(8, cols, dtype=torch.bool)
    inside[:4, :8] = True
    assert torch.equal(box[inside].reshape(4, 8), x[16:20, 16:24].cpu())
    assert torch.isnan(box[~inside].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, box, coords, element_strides",
    [
        ((1000,), (64,), (-16,), None),  # rank 1
        ((6, 40, 48), (2, 8, 32), (3, 30, 16), None),  # rank 3, ragged in dim 1
        ((3, 4, 10, 32), (2, 2, 4, 16), (1, 3, 8, 16), None),  # rank 4
        ((2, 3, 4, 10, 32), (2, 2, 2, 4, 16), (1, 2, 3, -2, 0), None),  # rank 5
        ((64, 64), (16, 32), (4, 16), (2, 1)),  # outer element stride 2
        ((4, 64, 64), (2, 16, 32), (1, 0, 32), (1, 4, 1)),
    ],
)
def test_probe_ranks_and_element_strides(shape, box, coords, element_strides, seeded):
    x = _bits_tensor(shape, torch.float16)
    _probe_case(x, box, coords, "none", element_strides=element_strides)
    if box[-1] * 2 <= 64:
        _probe_case(x, box, coords, "64B", element_strides=element_strides)


# ------------------------------------------------------------------ GPU: pipelined copy


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        CopyConfig(64, 64, "128B", 4),
        CopyConfig(128, 32, "64B", 3),
        CopyConfig(32, 16, "32B", 2),
        CopyConfig(256, 128, "none", 2),
        CopyConfig(16, 64, "128B", 8, ctas_per_sm=1),
    ],
)
@pytest.mark.parametrize("rows, cols", [(1, 64), (727, 1000), (4096, 512)])
def test_copy_exact(config, rows, cols, seeded):
    src_buffer, x = _padded(rows, cols, torch.bfloat16)
    x.copy_(_random((rows, cols), torch.bfloat16))
    out_buffer, out = _padded(rows, cols, torch.bfloat16, extra_rows=1)
    before = _bits(out_buffer).clone()
    tma_copy.copy_2d(x, out, config)
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(x))
    _assert_untouched(out_buffer, before, (slice(1, 1 + rows), slice(0, cols)))
