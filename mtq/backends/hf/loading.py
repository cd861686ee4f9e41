"""What the Hugging Face backends share: their common options, the dtype a device
gets, and loading a model and its tokenizer from a local folder or a hub name.

torch and transformers are imported inside the functions only.
"""

from __future__ import annotations

import os
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

    #: the hub commit the weights came from (set by load_pretrained; None for a folder)
    _commit_hash: str | None = None

    def weights_digest(self) -> str:
        """What identifies the weights, for the served version (mtq.workers.catalogue):
        the hub commit they came from, or the names, sizes and modification times of
        the folder's files. Cheap, where hashing every tensor of a multi-GB model is not."""
        if self._commit_hash:
            return f"hub:{self.model}@{self._commit_hash}"
        parts = [os.path.abspath(self.model)]
        if os.path.isdir(self.model):
            for entry in sorted(os.scandir(self.model), key=lambda e: e.name):
                if entry.is_file():
                    st = entry.stat()
                    parts.append(f"{entry.name}:{st.st_size}:{st.st_mtime_ns}")
        return "\n".join(parts)


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
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a worker's log is no terminal
    dtype = torch_dtype(opts.dtype, device)
    try:
        model = auto_class.from_pretrained(opts.model, revision=opts.revision, dtype=dtype,
                                           trust_remote_code=opts.trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load model {opts.model!r}: {exc}") from exc
    opts._commit_hash = getattr(model.config, "_commit_hash", None)
    return model.to(device).eval()
