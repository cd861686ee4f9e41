"""msgpack encoding of payloads and results; never pickle.

Anyone who can write to Redis must not be able to run code on a worker, so only
data types travel: None, bool, int, float, str, bytes, lists (tuples arrive as
lists), dicts, and two extension types:

* ``EXT_NDARRAY`` (1): a numpy array, as ``[dtype.str, shape, raw bytes]``;
* ``EXT_TENSOR`` (2): a torch tensor, as ``[dtype name, shape, raw bytes]``
  (moved to CPU; any dtype, bfloat16 included).

numpy and torch are imported only when such a value is met, so producers do not
need them installed.
"""

from __future__ import annotations

import sys
from typing import Any

import msgpack

from mtq.errors import EncodeError, PayloadError

EXT_NDARRAY = 1
EXT_TENSOR = 2


def _tensor_data(obj: Any) -> bytes:
    """A dense tensor as ``[dtype name, shape, raw bytes]`` (C order, on the host).
    Raises EncodeError for what has no such form (torch's own errors for these range
    from RuntimeError to a crash of the process: a quantized tensor's byte view)."""
    import torch

    t = obj.detach()
    if t.is_nested:
        raise EncodeError("nested tensors cannot be encoded; send a list of tensors")
    if t.layout != torch.strided:
        raise EncodeError(f"{t.layout} tensors cannot be encoded; send t.to_dense(), or "
                          "the indices and values as tensors of their own")
    if t.is_quantized:
        raise EncodeError("quantized tensors cannot be encoded; send t.dequantize(), or "
                          "t.int_repr() with its scale and zero point")
    if t.device.type == "meta":
        raise EncodeError("a tensor on the meta device holds no data; send a real one")
    try:
        t = t.resolve_conj().resolve_neg().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise EncodeError(f"a {t.dtype} tensor on {t.device} cannot be encoded ({exc}); "
                          "send a dense tensor of a plain dtype") from exc
    return msgpack.packb([str(t.dtype).removeprefix("torch."), list(t.shape), raw])


def _default(obj: Any) -> Any:
    module = type(obj).__module__
    if module == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise EncodeError("numpy arrays of dtype=object cannot be encoded (they hold "
                                  "Python objects); convert to a list or a numeric dtype first")
            if obj.dtype.fields is not None:
                raise EncodeError("structured numpy arrays cannot be encoded; send a dict of "
                                  "plain arrays (one per field) instead")
            # tobytes() is C order whatever the layout; ascontiguousarray would turn
            # a 0-d array into shape (1,).
            data = msgpack.packb([obj.dtype.str, list(obj.shape), obj.tobytes()])
            return msgpack.ExtType(EXT_NDARRAY, data)
        if isinstance(obj, np.generic):
            return obj.item()
    if module.startswith("torch") and type(obj).__name__ in ("Tensor", "Parameter"):
        return msgpack.ExtType(EXT_TENSOR, _tensor_data(obj))
    if isinstance(obj, int):
        raise EncodeError(f"integer {obj} is outside the 64-bit range msgpack carries; "
                          "send it as a str")
    raise EncodeError(
        f"cannot encode a {type(obj).__module__}.{type(obj).__qualname__}: payloads and "
        "results must be msgpack data (None, bool, int, float, str, bytes, list, dict, "
        "numpy arrays, torch tensors); convert it first"
    )


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_NDARRAY:
        import numpy as np

        dtype, shape, raw = msgpack.unpackb(data, raw=False)
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    if code == EXT_TENSOR:
        import torch

        name, shape, raw = msgpack.unpackb(data, raw=False)
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise PayloadError(f"unknown torch dtype {name!r} in payload")
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
    return msgpack.ExtType(code, data)


def dumps(value: Any) -> bytes:
    """Encode ``value``; raises EncodeError for values msgpack cannot carry."""
    try:
        return msgpack.packb(value, default=_default, use_bin_type=True, datetime=False)
    except EncodeError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise EncodeError(f"cannot encode value: {exc}") from exc


def loads(data: bytes) -> Any:
    """Decode bytes written by :func:`dumps`; raises PayloadError on garbage."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except PayloadError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise PayloadError(f"cannot decode stored value: {exc}") from exc


def torch_loaded() -> bool:
    """True if torch has been imported in this process (used by tests)."""
    return "torch" in sys.modules
