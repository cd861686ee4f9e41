"""What the Hugging Face backends share: their common options, the dtype a device
gets, and loading a model and its tokenizer from a local folder or a hub name.

torch and transformers are imported inside the functions only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mtq.errors import ConfigError
from mtq.workers.options import Option

if TYPE_CHECKING:
    import torch

#: the dtype option's values; "auto" follows the device (see :func:`torch_dtype`)
DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")


class HFOptions:
    """The options every Hugging Face backend declares (a mixin of the backends)."""

    model = Option(str, help="a local folder saved with save_pretrained, or a hub name "
                             "(downloaded to the Hugging Face cache unless HF_HUB_OFFLINE=1)")
    dtype = Option(str, "auto", choices=DTYPES,
                   help="auto: bfloat16 on a GPU that has it, else float16; float32 on the CPU")
    revision = Option(str, None, help="a hub revision (branch, tag or commit)")
    trust_remote_code = Option(bool, False, help="run the model repository's own code")


def torch_dtype(name: str, device: Any) -> torch.dtype:
    """The torch dtype for option value ``name`` on ``device``: ``auto`` is bfloat16 on
    a CUDA device that supports it, float16 on other CUDA devices and on MPS, and
    float32 on the CPU."""
    import torch

    if name != "auto":
        return getattr(torch, name)
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if kind == "mps":
        return torch.float16
    return torch.float32


def load_tokenizer(opts: HFOptions, **kwargs: Any) -> Any:
    """The model's tokenizer (``AutoTokenizer.from_pretrained``); a ConfigError naming
    the model when it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(opts.model, revision=opts.revision,
                                             trust_remote_code=opts.trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the tokenizer of {opts.model!r}: {exc}") from exc


def load_pretrained(auto_class: Any, opts: HFOptions, device: Any, **kwargs: Any) -> Any:
    """``auto_class.from_pretrained`` of the model option, in the dtype option's dtype,
    on ``device``, in eval mode; a ConfigError naming the model when it cannot be
    loaded."""
    dtype = torch_dtype(opts.dtype, device)
    try:
        model = auto_class.from_pretrained(opts.model, revision=opts.revision, dtype=dtype,
                                           trust_remote_code=opts.trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load model {opts.model!r}: {exc}") from exc
    return model.to(device).eval()
