"""Tensor-map validation (CPU), swizzle reference math (CPU), encoding and the map cache (GPU)."""

import ctypes

import pytest
import torch

from tmagemm import tma


def params(**overrides):
    base = dict(
        dtype="float16",
        global_address=0x10000,
        global_dims=(128, 64),
        global_strides=(256,),
        box_dims=(64, 32),
        element_strides=(1, 1),
        interleave="none",
        swizzle="128B",
        l2_promotion="128B",
        oob_fill="zero",
    )
    base.update(overrides)
    return tma.TiledParams(**base)


# ------------------------------------------------------------------ validation: accepted cases


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(dtype="uint8", box_dims=(128, 8)),
        dict(dtype="float32", box_dims=(32, 8), swizzle="128B"),
        dict(dtype="float64", box_dims=(8, 8), swizzle="64B"),
        dict(dtype="bfloat16", box_dims=(16, 8), swizzle="32B"),
        dict(dtype="int64", box_dims=(256, 256), swizzle="none", oob_fill="zero"),  # box limit 256
        dict(global_dims=(1 << 32, 1), global_strides=(16,), box_dims=(64, 1)),  # dims up to 2^32
        dict(global_strides=((1 << 40) - 16,)),  # strides below 2^40
        dict(element_strides=(8, 8)),
        dict(dtype="tfloat32", oob_fill="nan", box_dims=(32, 4)),
        dict(l2_promotion="none"),
        dict(l2_promotion="256B"),
        dict(global_dims=(1000,), global_strides=(), box_dims=(64,), element_strides=(1,)),  # rank 1
        dict(
            global_dims=(8, 8, 8, 8, 8),
            global_strides=(16, 128, 1024, 8192),
            box_dims=(8, 2, 2, 2, 2),
            element_strides=(1,) * 5,
        ),  # rank 5
        dict(
            interleave="16B",
            swizzle="none",
            global_dims=(8, 16, 16),
            global_strides=(16, 256),
            box_dims=(8, 8, 8),
            element_strides=(1, 1, 1),
        ),
        dict(
            interleave="32B",
            swizzle="32B",
            global_address=0x10020,
            global_dims=(16, 16, 16),
            global_strides=(32, 512),
            box_dims=(16, 8, 8),
            element_strides=(1, 1, 1),
        ),
    ],
)
def test_valid_params_pass(overrides):
    params(**overrides).validate()


# ------------------------------------------------------------------ validation: one case per rule


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(global_dims=(), global_strides=(), box_dims=(), element_strides=()), "rank must be 1..5"),
        (dict(global_dims=(2,) * 6, global_strides=(16,) * 5, box_dims=(8,) * 6, element_strides=(1,) * 6), "rank must be 1..5"),
        (dict(interleave="16B", swizzle="none"), "needs rank >= 3"),
        (dict(global_strides=(256, 256)), "global_strides needs 1 entries"),
        (dict(box_dims=(64,)), "box_dims needs 2 entries"),
        (dict(element_strides=(1, 1, 1)), "element_strides needs 2 entries"),
        (dict(global_address=0x10008), "global address must be 16-byte aligned"),
        (
            dict(interleave="32B", swizzle="32B", global_address=0x10010, global_dims=(16, 16, 16),
                 global_strides=(32, 512), box_dims=(16, 8, 8), element_strides=(1, 1, 1)),
            "must be 32-byte aligned with interleave=32B",
        ),
        (dict(global_dims=(0, 64)), "global_dims[0] must be in 1..2^32"),
        (dict(global_dims=(128, (1 << 32) + 1)), "global_dims[1] must be in 1..2^32"),
        (dict(global_strides=(264,)), "multiple of 16 bytes, got 264"),
        (dict(global_strides=(1 << 40,)), "below 2^40"),
        (
            dict(interleave="32B", swizzle="32B", global_address=0x10020, global_dims=(16, 16, 16),
                 global_strides=(48, 768), box_dims=(16, 8, 8), element_strides=(1, 1, 1)),
            "multiple of 32 bytes, got 48",
        ),
        (dict(box_dims=(64, 0)), "box_dims[1] must be in 1..256"),
        (dict(box_dims=(64, 257)), "box_dims[1] must be in 1..256"),
        (dict(box_dims=(12, 8), swizzle="none"), "multiple of 16 bytes, got 12*2 = 24"),
        (dict(element_strides=(1, 0)), "element_strides[1] must be in 1..8"),
        (dict(element_strides=(9, 1)), "element_strides[0] must be in 1..8"),
        (dict(box_dims=(32, 8), swizzle="32B"), "swizzle span (32B = 32 bytes), got 32*2 = 64"),
        (dict(box_dims=(64, 8), swizzle="64B"), "swizzle span (64B = 64 bytes), got 64*2 = 128"),
        (dict(box_dims=(128, 8), swizzle="128B"), "swizzle span (128B = 128 bytes), got 128*2 = 256"),
        (
            dict(interleave="32B", swizzle="64B", global_address=0x10020, global_dims=(16, 16, 16),
                 global_strides=(32, 512), box_dims=(16, 8, 8), element_strides=(1, 1, 1)),
            "interleave=32B requires swizzle=32B",
        ),
        (dict(dtype="int32", box_dims=(32, 8), oob_fill="nan"), "oob_fill='nan' needs a floating-point"),
        (dict(dtype="uint8", box_dims=(128, 8), oob_fill="nan"), "oob_fill='nan' needs a floating-point"),
        (dict(swizzle="256B"), "swizzle must be one of"),
        (dict(interleave="64B"), "interleave must be one of"),
        (dict(l2_promotion="512B"), "l2_promotion must be one of"),
        (dict(oob_fill="inf"), "oob_fill must be one of"),
    ],
)
def test_invalid_params_name_the_rule(overrides, message):
    with pytest.raises(tma.TensorMapError) as info:
        params(**overrides).validate()
    assert message in str(info.value)


def test_unknown_data_type_is_a_type_error():
    with pytest.raises(TypeError, match="unknown TMA data type"):
        params(dtype="int8").validate()


# ------------------------------------------------------------------ tensors -> params (CPU)


def test_params_for_tensor_reverses_dims_and_keeps_padded_strides():
    buf = torch.zeros(40, 3, 72, dtype=torch.float16)
    view = buf[:33, :, :70]
    p = tma.params_for_tensor(view, (8, 1, 64), swizzle="128B", element_strides=(2, 1, 1))
    assert p.global_dims == (70, 3, 33)
    assert p.global_strides == (72 * 2, 3 * 72 * 2)
    assert p.box_dims == (64, 1, 8)
    assert p.element_strides == (1, 1, 2)
    assert p.global_address == view.data_ptr()
    assert p.box_elements == (64, 1, 4)
    assert p.box_bytes == 64 * 1 * 4 * 2


@pytest.mark.parametrize(
    "dtype, name",
    [
        (torch.float8_e4m3fn, "uint8"),
        (torch.float8_e5m2, "uint8"),
        (torch.int8, "uint8"),
        (torch.bfloat16, "bfloat16"),
        (torch.float16, "float16"),
        (torch.int32, "int32"),
        (torch.float32, "float32"),
        (torch.float64, "float64"),
        (torch.int64, "int64"),
        (torch.complex64, "uint64"),
    ],
)
def test_torch_dtypes_map_to_tma_types(dtype, name):
    x = torch.zeros(4, 64, dtype=dtype)
    cols = 16 // x.element_size()
    assert tma.params_for_tensor(x, (2, cols), swizzle="none").dtype == name


def test_dtype_override_must_keep_the_element_size():
    x = torch.zeros(8, 32, dtype=torch.float32)
    assert tma.params_for_tensor(x, (8, 32), dtype="tfloat32").dtype == "tfloat32"
    with pytest.raises(tma.TensorMapError, match="2-byte elements"):
        tma.params_for_tensor(x, (8, 32), dtype="bfloat16")


def test_complex128_has_no_tma_type():
    with pytest.raises(TypeError, match="no TMA data type"):
        tma.params_for_tensor(torch.zeros(4, 4, dtype=torch.complex128), (4, 4))


def test_tensor_rules_are_checked():
    x = torch.zeros(64, 64, dtype=torch.float16)
    with pytest.raises(tma.TensorMapError, match="last dimension must be contiguous"):
        tma.params_for_tensor(x.t(), (8, 8))
    with pytest.raises(tma.TensorMapError, match="non-zero"):
        tma.params_for_tensor(x[:0], (8, 64))
    with pytest.raises(tma.TensorMapError, match="box_shape"):
        tma.params_for_tensor(x, (8,))
    with pytest.raises(tma.TensorMapError, match="multiple of 16 bytes, got 126"):
        tma.params_for_tensor(torch.zeros(8, 63, dtype=torch.float16), (8, 8), swizzle="none")
    with pytest.raises(tma.TensorMapError, match="needs a CUDA tensor"):
        tma.make_tensor_map(x, (8, 64))


def test_size_one_dims_get_a_valid_stride():
    x = torch.zeros(5 * 64, dtype=torch.float32).as_strided((1, 5, 64), (7, 64, 1))
    p = tma.params_for_tensor(x, (1, 2, 32))
    assert p.global_strides == (256, 5 * 256)


# ------------------------------------------------------------------ driver error decoding (CPU)


def test_driver_refusal_reports_decoded_params(monkeypatch):
    class FakeDriver:
        def cuTensorMapEncodeTiled(self, *args):
            return 1  # CUDA_ERROR_INVALID_VALUE

        def cuGetErrorName(self, code, out):
            ctypes.cast(out, ctypes.POINTER(ctypes.c_char_p))[0] = b"CUDA_ERROR_INVALID_VALUE"
            return 0

    monkeypatch.setattr(tma, "_libcuda", lambda: FakeDriver())
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(tma.TensorMapError) as info:
        tma.encode(params())
    text = str(info.value)
    assert "CUDA_ERROR_INVALID_VALUE" in text and "box_dims=[64, 32]" in text and "innermost first" in text


# ------------------------------------------------------------------ swizzle reference (CPU)


@pytest.mark.parametrize("mode", ["none", "32B", "64B", "128B"])
def test_swizzle_is_a_bijection_on_each_1024_byte_block(mode):
    for base in (0, 1024, 7 * 1024):
        images = {tma.swizzle_offset(base + i, mode) for i in range(1024)}
        assert images == set(range(base, base + 1024))


def test_swizzle_none_is_identity():
    assert all(tma.swizzle_offset(i, "none") == i for i in range(4096))


@pytest.mark.parametrize("mode, span", [("32B", 32), ("64B", 64), ("128B", 128)])
def test_swizzle_moves_16_byte_chunks_within_their_span(mode, span):
    for offset in range(0, 8192, 3):
        out = tma.swizzle_offset(offset, mode)
        assert out % 16 == offset % 16  # bytes inside a 16-byte chunk stay together
        assert out // span == offset // span  # chunks never leave their span-sized segment
        row, chunk = offset // 128, (offset % 128) // 16
        assert (out % 128) // 16 == chunk ^ (row % (span // 16))


def test_swizzle_known_values():
    # 128B: row r of a 128-byte-wide tile has its chunk j at chunk j ^ (r % 8).
    assert tma.swizzle_offset(3 * 128 + 1 * 16 + 5, "128B") == 3 * 128 + (1 ^ 3) * 16 + 5
    assert tma.swizzle_offset(7 * 128, "64B") == 7 * 128 + 3 * 16
    assert tma.swizzle_offset(5 * 128 + 16, "32B") == 5 * 128  # odd rows swap the two halves of a 32 B span
    assert tma.swizzle_offset(2 * 128 + 16, "32B") == 2 * 128 + 16


@pytest.mark.parametrize("mode", ["none", "32B", "64B", "128B"])
def test_swizzle_tile_agrees_with_offsets(mode):
    dense = torch.randint(0, 256, (2048,), dtype=torch.uint8)
    image = tma.swizzle_tile(dense, mode)
    for i in range(0, 2048, 7):
        assert image[tma.swizzle_offset(i, mode)] == dense[i]


@pytest.mark.parametrize("mode, row_bytes, pitch", [("none", 48, 48), ("32B", 32, 32), ("64B", 32, 64), ("128B", 64, 128), ("128B", 128, 128)])
def test_smem_image_pads_rows_to_the_span(mode, row_bytes, pitch):
    rows = 9
    dense = torch.randint(0, 256, (rows * row_bytes,), dtype=torch.uint8)
    image = tma.smem_image(dense, row_bytes, mode, fill=0xA5)
    assert image.numel() == -(-(rows * pitch) // 128) * 128
    for r in range(rows):
        for b in range(0, row_bytes, 5):
            assert image[tma.swizzle_offset(r * pitch + b, mode)] == dense[r * row_bytes + b]
    assert (image == 0xA5).sum() >= image.numel() - dense.numel()  # padding keeps the fill


def test_smem_footprint_of_params():
    p = params(dtype="float32", box_dims=(16, 9), swizzle="128B")  # 64-byte rows in a 128-byte span
    assert p.box_bytes == 16 * 9 * 4 and p.smem_row_bytes == 128 and p.smem_bytes == 9 * 128
    q = params(dtype="float32", box_dims=(16, 9), swizzle="none")
    assert q.smem_bytes == q.box_bytes == 16 * 9 * 4


def test_swizzle_reference_rejects_bad_input():
    with pytest.raises(ValueError):
        tma.swizzle_offset(0, 48)
    with pytest.raises(ValueError):
        tma.swizzle_offset(-1, "128B")
    with pytest.raises(ValueError, match="multiple of 128"):
        tma.swizzle_tile(torch.zeros(100, dtype=torch.uint8), "32B")


# ------------------------------------------------------------------ encoding and cache (GPU)


@pytest.mark.gpu
def test_encode_and_replace_address_matches_fresh_encode():
    a = torch.randn(256, 128, device="cuda", dtype=torch.float16)
    b = torch.randn(256, 128, device="cuda", dtype=torch.float16)
    map_a = tma.make_tensor_map(a, (64, 64))
    map_b = tma.make_tensor_map(b, (64, 64))
    assert map_a.address % 64 == 0
    assert map_a.to_bytes() != map_b.to_bytes()
    map_a.replace_address(b.data_ptr())
    assert map_a.to_bytes() == map_b.to_bytes()
    assert map_a.global_address == b.data_ptr()


class _FakeMap:
    def __init__(self, address):
        self.global_address = address

    def replace_address(self, address):
        self.global_address = address


def test_cache_slots_per_layout(monkeypatch):
    made = []

    def fake_make(tensor, box_shape, **options):
        made.append(_FakeMap(tensor.data_ptr()))
        return made[-1]

    monkeypatch.setattr(tma, "make_tensor_map", fake_make)
    cache = tma.TensorMapCache(per_layout=2)
    a, b, c = (torch.zeros(8, 64) for _ in range(3))
    map_a, map_b = cache.get(a, (8, 64)), cache.get(b, (8, 64))
    assert map_a is not map_b and cache.encodes == 2  # same layout, both live: no aliasing
    assert cache.get(a, (8, 64)) is map_a and cache.get(b, (8, 64)) is map_b  # hits
    map_c = cache.get(c, (8, 64))  # third address: the least recently used slot (a) is retargeted
    assert map_c is map_a and map_c.global_address == c.data_ptr() and cache.replacements == 1
    assert cache.get(b, (8, 64)) is map_b and map_b.global_address == b.data_ptr()
    other = cache.get(torch.zeros(8, 32), (8, 32))  # another layout never shares a map
    assert other not in (map_a, map_b) and cache.encodes == 3


@pytest.mark.gpu
def test_cache_replaces_address_and_never_reuses_a_mismatched_map():
    cache = tma.TensorMapCache(per_layout=1)
    a = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    first = cache.get(a, (64, 64))
    again = cache.get(b, (64, 64))
    assert again is first and cache.replacements == 1 and cache.encodes == 1
    assert again.to_bytes() == tma.make_tensor_map(b, (64, 64)).to_bytes()
    other_shape = cache.get(torch.randn(64, 64, device="cuda", dtype=torch.bfloat16), (64, 64))
    other_dtype = cache.get(torch.randn(128, 64, device="cuda", dtype=torch.float16), (64, 64))
    other_stride = cache.get(torch.randn(128, 72, device="cuda", dtype=torch.bfloat16)[:, :64], (64, 64))
    assert len({id(m) for m in (first, other_shape, other_dtype, other_stride)}) == 4
    assert cache.encodes == 4


# ------------------------------------------------------------------------------ operand layouts

@pytest.mark.parametrize("shape, strides, want", [
    ((64, 32), (32, 1), 1),  # row-major
    ((64, 32), (1, 64), 0),  # column-major (w.t() of a (32, 64) weight)
    ((64, 32), (64, 2), None),  # neither dimension contiguous
    ((64, 1), (1, 1), 0),  # a K-vector B (w.t() of a (1, K) weight): K-major
    ((64, 1), (8, 1), 1),  # a column sliced from a row-major matrix: rows 8 elements apart
    ((1, 32), (32, 1), 1),  # one row: row-major
    ((1, 32), (1, 8), 0),  # a row sliced from a column-major matrix: columns 8 apart
    ((1, 1), (1, 1), 1),
])
def test_contiguous_dim_tie_breaks(shape, strides, want):
    t = torch.empty_strided(shape, strides, dtype=torch.float16)
    assert tma.contiguous_dim(t) == want
    assert tma.b_is_k_major(t) == (want == 0)


def test_leading_stride_and_operand_reason():
    t = torch.empty(64, 40, dtype=torch.float16)[:, :36]  # rows 80 bytes apart
    assert tma.leading_stride(t, True) == 40
    assert tma.operand_reason(t, "a", True) is None
    assert "column-major" in tma.operand_reason(t, "a", False)
    one_row = torch.empty(1, 36, dtype=torch.float16)
    assert tma.leading_stride(one_row, True) == 40  # never stepped: the smallest 16-byte multiple
    odd = torch.empty(64, 37, dtype=torch.float16)[:, :36]  # 74-byte rows
    assert "not a multiple of 16" in tma.operand_reason(odd, "b", True)
    assert tma.store_reason(torch.empty(8, 36, dtype=torch.float16)) is not None  # 72-byte rows
    assert tma.store_reason(torch.empty(8, 40, dtype=torch.float16)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("inner", [0, 1])
def test_aligned_copy_is_what_a_map_describes(dtype, inner):
    """The same values, contiguous along ``inner``, the other stride rounded up to 16 bytes (for
    1x128 scales contiguous along M: DeepGEMM's layout, e.g. 727 rows -> stride 728), in a buffer
    that ends at the last element."""
    t = (torch.rand(727, 57) * 8).to(dtype)
    copy = tma.aligned_copy(t, inner)
    per_16b = 16 // t.element_size()
    lead = -(-t.shape[inner] // per_16b) * per_16b
    assert copy.shape == t.shape and copy.stride() == ((lead, 1) if inner == 1 else (1, lead))
    assert torch.equal(copy.float(), t.float())
    assert copy.untyped_storage().nbytes() == ((t.shape[1 - inner] - 1) * lead + t.shape[inner]) * t.element_size()
    assert tma.map_reason(copy, "t", (1 - inner, inner), address=False) is None
    if dtype == torch.float32 and inner == 0:
        assert copy.stride() == (1, 728)


def test_aligned_copy_refuses_what_it_cannot_lay_out():
    with pytest.raises(ValueError, match="2-D"):
        tma.aligned_copy(torch.rand(2, 3, 4), 0)
    with pytest.raises(ValueError, match="inner 0 or 1"):
        tma.aligned_copy(torch.rand(2, 3), 2)
