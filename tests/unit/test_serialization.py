"""Round trips and failure modes of mtq.serialization (msgpack, never pickle)."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings

import msgpack
import pytest

import mtq
from mtq import serialization
from mtq.errors import EncodeError, PayloadError

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")


def roundtrip(value):
    return serialization.loads(serialization.dumps(value))


# -- plain data ------------------------------------------------------------------
PLAIN = [
    None, True, False, 0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1,
    1.5, -0.0, float("inf"), float("-inf"), 1e308,
    "", "héllo ✓ ユーザー", "x" * 10_000,
    b"", b"\x00\xff\x80", bytes(range(256)),
    [], [1, [2, [3, [4]]]], [None, True, 1, 1.0, "s", b"b"],
    {}, {"a": {"b": [1, None, {"c": b"d"}]}},
    {1: "one", 2: [b"two"], -3: {4: None}},
    {"mixed": [{"k": [1, 2.5, "three"]}, [], {}]},
]


@pytest.mark.parametrize("value", PLAIN, ids=[repr(v)[:30] for v in PLAIN])
def test_plain_round_trip(value):
    out = roundtrip(value)
    assert out == value
    assert type(out) is type(value)


def test_bool_stays_bool_and_int_stays_int():
    out = roundtrip([True, 1, False, 0])
    assert [type(v) for v in out] == [bool, int, bool, int]


def test_nan_round_trips():
    assert math.isnan(roundtrip(float("nan")))


def test_tuple_arrives_as_list():
    assert roundtrip((1, (2, 3))) == [1, [2, 3]]


def test_dumps_returns_bytes():
    assert isinstance(serialization.dumps({"x": 1}), bytes)


# -- numpy -----------------------------------------------------------------------
NP_DTYPES = ["float32", "float64", "float16", "int8", "uint16", "int32", "int64", "bool",
             "complex64", ">i4", "<U3", "datetime64[s]"]
NP_SHAPES = [(0,), (3,), (2, 3), (0, 4), (2, 3, 4)]


def _np_array(dtype, shape):
    n = int(np.prod(shape)) if shape else 1
    base = np.arange(n) % 7
    if np.dtype(dtype).kind == "U":
        return np.array([f"s{v}" for v in base], dtype=dtype).reshape(shape)
    return base.astype(dtype).reshape(shape)


@pytest.mark.parametrize("shape", NP_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", NP_DTYPES)
def test_numpy_round_trip(dtype, shape):
    arr = _np_array(dtype, shape)
    out = roundtrip(arr)
    assert isinstance(out, np.ndarray)
    assert out.dtype == arr.dtype
    assert out.shape == arr.shape
    assert np.array_equal(out, arr)
    assert out.flags.writeable, "a decoded array must be writeable (its own copy)"


@pytest.mark.parametrize("dtype", ["int64", "float32", "bool"])
def test_numpy_zero_dim_keeps_its_shape(dtype):
    arr = np.array(5, dtype=dtype)
    out = roundtrip(arr)
    assert out.shape == ()
    assert out.dtype == arr.dtype
    assert out == arr


def test_numpy_zero_dim_value_survives():
    # Independent of the shape bug above: the value and dtype come through.
    out = roundtrip(np.array(2.5, dtype=np.float32))
    assert out.dtype == np.float32
    assert float(out.reshape(())) == 2.5


@pytest.mark.parametrize("make", [
    lambda: np.arange(12).reshape(3, 4).T,
    lambda: np.arange(20, dtype=np.float32)[::3],
    lambda: np.arange(24).reshape(2, 3, 4)[:, 1:, ::2],
], ids=["transposed", "strided", "sliced-3d"])
def test_numpy_non_contiguous(make):
    arr = make()
    assert not arr.flags.c_contiguous
    out = roundtrip(arr)
    assert out.shape == arr.shape and out.dtype == arr.dtype
    assert np.array_equal(out, arr)


def test_numpy_structured_dtype_round_trips_or_is_refused():
    arr = np.array([(1, 2.5)], dtype=[("a", "<i4"), ("b", "<f4")])
    try:
        out = roundtrip(arr)
    except EncodeError:
        return
    assert out.dtype == arr.dtype
    assert out["a"][0] == 1


@pytest.mark.parametrize("scalar,expected,kind", [
    (np.int64(3), 3, int), (np.int32(-7), -7, int), (np.uint8(255), 255, int),
    (np.float32(1.5), 1.5, float), (np.float64(2.25), 2.25, float), (np.bool_(True), True, bool),
], ids=lambda v: type(v).__name__)
def test_numpy_scalar_becomes_python_number(scalar, expected, kind):
    out = roundtrip(scalar)
    assert out == expected
    assert type(out) is kind


def test_numpy_scalars_inside_containers():
    assert roundtrip({"n": np.int32(7), "xs": [np.float32(0.5)]}) == {"n": 7, "xs": [0.5]}


# -- torch -----------------------------------------------------------------------
TORCH_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64]
TORCH_SHAPES = [(), (0,), (5,), (2, 3), (0, 3), (2, 1, 4)]


def _tensor(dtype, shape):
    n = math.prod(shape)
    return (torch.arange(n) % 5).to(dtype).reshape(shape)


@pytest.mark.parametrize("shape", TORCH_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_round_trip(dtype, shape):
    t = _tensor(dtype, shape)
    out = roundtrip(t)
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype
    assert tuple(out.shape) == shape
    assert out.device.type == "cpu"
    assert torch.equal(out, t)


def test_torch_bfloat16_values_exact():
    t = torch.tensor([1.5, -2.25, 3.0e38, 1e-38, 0.0], dtype=torch.bfloat16)
    out = roundtrip(t)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, t)
    # bit-exact, not merely close
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))


def test_torch_int64_extremes():
    t = torch.tensor([-(2**63), 2**63 - 1, 0], dtype=torch.int64)
    assert torch.equal(roundtrip(t), t)


def test_torch_empty():
    out = roundtrip(torch.empty(0, 7, dtype=torch.float16))
    assert out.shape == (0, 7) and out.dtype == torch.float16


@pytest.mark.parametrize("make", [
    lambda: torch.arange(12).reshape(3, 4).t(),
    lambda: torch.arange(20.0)[::3],
    lambda: torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)[:, 1:, ::2],
    lambda: torch.arange(6).reshape(2, 3).expand(4, 2, 3),
], ids=["transposed", "strided", "sliced-bf16", "expanded"])
def test_torch_non_contiguous(make):
    t = make()
    assert not t.is_contiguous()
    out = roundtrip(t)
    assert out.shape == t.shape and out.dtype == t.dtype
    assert torch.equal(out, t)
    assert out.is_contiguous()


def test_torch_tensor_on_cpu_device():
    t = torch.ones(3, 2, device="cpu")
    out = roundtrip(t)
    assert out.device == torch.device("cpu")
    assert torch.equal(out, t)


def test_torch_requires_grad_and_parameter_are_detached():
    t = torch.ones(3, requires_grad=True)
    p = torch.nn.Parameter(torch.full((2,), 4.0))
    out_t, out_p = roundtrip([t, p])
    assert not out_t.requires_grad and torch.equal(out_t, t.detach())
    assert type(out_p) is torch.Tensor and torch.equal(out_p, p.detach())


def test_decoded_tensor_is_writeable():
    out = roundtrip(torch.arange(4.0))
    out += 1  # must not share a read-only buffer
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_mixed_container_with_arrays_and_tensors():
    value = {"ids": torch.arange(3), "emb": np.ones((2, 2), dtype=np.float32), "meta": {1: "a"}}
    out = roundtrip(value)
    assert torch.equal(out["ids"], value["ids"])
    assert np.array_equal(out["emb"], value["emb"])
    assert out["meta"] == {1: "a"}


# -- refusals --------------------------------------------------------------------
@pytest.mark.parametrize("value", [object(), {1, 2}, frozenset(), {"nested": [object()]},
                                   complex(1, 2)],
                         ids=["object", "set", "frozenset", "nested-object", "complex"])
def test_unencodable_raises_encode_error_with_advice(value):
    with pytest.raises(EncodeError) as info:
        serialization.dumps(value)
    exc = info.value
    assert isinstance(exc, PayloadError) and isinstance(exc, TypeError)
    assert isinstance(exc, mtq.MtqError)
    msg = str(exc)
    assert "convert it first" in msg
    assert "msgpack" in msg


def test_numpy_object_array_raises_encode_error():
    with pytest.raises(EncodeError) as info:
        serialization.dumps(np.array([object(), 1], dtype=object))
    assert "dtype=object" in str(info.value)


def test_numpy_object_array_message_says_what_to_do():
    with pytest.raises(EncodeError) as info:
        serialization.dumps(np.array([object(), 1], dtype=object))
    msg = str(info.value).lower()
    assert any(word in msg for word in ("convert", "instead", "use "))


def test_huge_int_message_mentions_range():
    with pytest.raises(EncodeError) as info:
        serialization.dumps(2**70)
    msg = str(info.value)
    assert "64" in msg or "range" in msg


def test_huge_int_is_refused():
    with pytest.raises(EncodeError):
        serialization.dumps({"big": 2**70})


# -- garbage in ------------------------------------------------------------------
GARBAGE = {
    "reserved-byte": b"\xc1",
    "truncated-array": b"\x93\x01",
    "extra-data": b"\x01\x02",
    "empty": b"",
    "truncated-str": b"\xa5ab",
    "ndarray-ext-not-a-list": b"\xd4\x01\x00",
    "tensor-ext-not-a-list": b"\xd4\x02\x00",
    "tensor-ext-bad-dtype": msgpack.packb(
        msgpack.ExtType(2, msgpack.packb(["load", [1], b"\x00"]))),
    "ndarray-ext-object-dtype": msgpack.packb(
        msgpack.ExtType(1, msgpack.packb(["|O", [1], b"\x00" * 8]))),
    "ndarray-ext-wrong-size": msgpack.packb(
        msgpack.ExtType(1, msgpack.packb(["<f8", [4], b"\x00" * 7]))),
    "tensor-ext-wrong-size": msgpack.packb(
        msgpack.ExtType(2, msgpack.packb(["float32", [4], b"\x00" * 3]))),
}


@pytest.mark.parametrize("data", list(GARBAGE.values()), ids=list(GARBAGE))
def test_garbage_raises_payload_error(data):
    with pytest.raises(PayloadError):
        serialization.loads(data)


def test_unknown_torch_dtype_is_named():
    data = GARBAGE["tensor-ext-bad-dtype"]
    with pytest.raises(PayloadError, match="unknown torch dtype 'load'"):
        serialization.loads(data)


# -- lazy imports ----------------------------------------------------------------
def test_plain_payloads_do_not_import_torch_or_numpy():
    code = (
        "import sys\n"
        "import mtq\n"
        "from mtq import serialization as s\n"
        "v = {'a': [1, 2.5, 'x', b'y', None, True], 3: {'n': []}}\n"
        "assert s.loads(s.dumps(v)) == v\n"
        "bad = sorted(m for m in ('torch', 'numpy') if m in sys.modules)\n"
        "assert not bad, f'imported: {bad}'\n"
        "assert not s.torch_loaded()\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("make, hint", [
    (lambda torch: torch.eye(3).to_sparse(), "to_dense"),
    (lambda torch: torch.eye(3).to_sparse_csr(), "to_dense"),
    (lambda torch: torch.empty(3, device="meta"), "meta device"),
    (lambda torch: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "list of tensors"),
], ids=["sparse-coo", "sparse-csr", "meta", "nested"])
def test_a_tensor_with_no_dense_bytes_is_an_encode_error(make, hint):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR and nested tensors warn: beta, prototype
        t = make(torch)
    with pytest.raises(EncodeError, match=hint):
        serialization.dumps({"x": t})


def test_a_quantized_tensor_is_an_encode_error_not_a_crash():
    # its byte view crashed the process (SIGSEGV): run apart, so a regression fails
    # this test rather than the whole run
    code = ("import warnings; warnings.simplefilter('ignore'); import torch\n"
            "from mtq import serialization\n"
            "from mtq.errors import EncodeError\n"
            "t = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)\n"
            "try:\n    serialization.dumps(t)\n"
            "except EncodeError as e:\n    print('EncodeError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("EncodeError:") and "dequantize" in out.stdout, out.stdout


def test_conjugate_and_negative_views_encode_their_values():
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    for t in (z.conj(), z.conj().imag, torch.arange(6.0).reshape(2, 3).T):
        back = serialization.loads(serialization.dumps(t))
        assert torch.equal(back, t.resolve_conj().resolve_neg()) and back.dtype == t.dtype
