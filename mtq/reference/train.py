"""Train the weights TinyGPT ships (:data:`mtq.reference.weights.TRAINED_WEIGHTS`).

``python -m mtq.reference.train`` trains the default :class:`GPTConfig` on the text
of *Pride and Prejudice* (Jane Austen, 1813; public domain), kept in the repository
at ``scripts/train-reference/pride-and-prejudice.txt``, on the CPU, from a fixed
seed, and writes the weights in float16. The paragraphs make one token stream
``p1 EOS p2 EOS ...``; a training window is BOS followed by the stream from the
start of a random word, as a served request is BOS followed by a prompt, so the
model continues a prompt to the end of its paragraph and then emits EOS. (Windows
that all began at a paragraph would have it learn those openings by heart.) The
steps cycle through windows of a quarter, a quarter, a half and all of ``--seq``
(512) tokens, the same tokens in each step (:func:`window`): short windows are
cheaper (attention) and more of them make a step's gradient less noisy, and every
position is trained from the start (a model trained on short windows first, then
on longer ones, did worse on the later positions; one trained on 512-token
windows only learned slower). The last 5 % of the paragraphs are held out to
measure the loss on text it never saw.

The shipped file came from ``python -m mtq.reference.train`` with the defaults
below (seed 0, 2 threads); see ``scripts/train-reference/README.md`` for its time,
its losses and the machine. torch is imported only inside functions.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtq.reference.tokenizer import BOS, EOS, encode
from mtq.reference.weights import TRAINED_WEIGHTS, GPTConfig, init_module, save_atomic

if TYPE_CHECKING:
    import torch

__all__ = ["CORPUS", "paragraphs", "train"]

#: the training text, in the repository (not in the installed package)
CORPUS = Path(__file__).resolve().parents[2] / "scripts" / "train-reference" / \
    "pride-and-prejudice.txt"
_HEADING = re.compile(r"(Chapter \d+|PRIDE AND PREJUDICE|By Jane Austen)")


def paragraphs(text: str) -> list[str]:
    """The paragraphs of ``text``: blank-line separated, each on one line (its line
    breaks are the printer's, not the author's), without chapter headings or the
    underscores that mark italics."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        para = " ".join(block.replace("_", "").split())
        if para and not _HEADING.fullmatch(para):
            out.append(para)
    return out


def _stream(paras: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """All paragraphs as one token stream ``EOS p1 EOS p2 EOS ...`` and the
    positions where a word starts in it (after a space or an EOS)."""
    import torch

    ids: list[int] = [EOS]
    for p in paras:
        ids += [*encode(p), EOS]
    stream = torch.tensor(ids)
    after = (stream[:-1] == ord(" ")) | (stream[:-1] == EOS)
    return stream, torch.nonzero(after)[:, 0] + 1


def forward(module: torch.nn.ModuleDict, config: GPTConfig, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, L, vocab] of a batch of token windows [B, L]: the computation of
    :class:`mtq.reference.decoder.CachedDecoder` (pre-LayerNorm blocks, causal
    attention, exact GELU, a head tied to the token embedding), batched for training."""
    import torch.nn.functional as F

    b, n = ids.shape
    d, h = config.d_model, config.n_head
    w: dict[str, torch.Tensor] = dict(module.named_parameters())
    x = w["tok.weight"][ids] + w["pos.weight"][:n]
    for i in range(config.n_layer):
        blk = {k.removeprefix(f"blocks.{i}."): t for k, t in w.items()
               if k.startswith(f"blocks.{i}.")}
        y = F.layer_norm(x, (d,), blk["ln1.weight"], blk["ln1.bias"])
        qkv = F.linear(y, blk["qkv.weight"], blk["qkv.bias"])
        q, k, v = qkv.view(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)  # [B, H, L, hd] each
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(att.transpose(1, 2).reshape(b, n, d), blk["proj.weight"],
                         blk["proj.bias"])
        y = F.layer_norm(x, (d,), blk["ln2.weight"], blk["ln2.bias"])
        x = x + F.linear(F.gelu(F.linear(y, blk["fc.weight"], blk["fc.bias"])),
                         blk["out.weight"], blk["out.bias"])
    x = F.layer_norm(x, (d,), w["ln_f.weight"], w["ln_f.bias"])
    return x @ w["tok.weight"].T


def _windows(stream: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    """[len(starts), seq + 1] windows: BOS, then ``stream`` from each start."""
    import torch

    win = stream[starts[:, None] - 1 + torch.arange(seq + 1)]
    win[:, 0] = BOS
    return win


def _loss(module: torch.nn.ModuleDict, config: GPTConfig, win: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    logits = forward(module, config, win[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), win[:, 1:].reshape(-1))


def _evaluate(module: torch.nn.ModuleDict, config: GPTConfig, windows: torch.Tensor) -> float:
    """Mean loss (nats per token) over ``windows``, in chunks of 16."""
    import torch

    with torch.no_grad():
        losses = [float(_loss(module, config, windows[i:i + 16]))
                  for i in range(0, len(windows), 16)]
    return sum(losses) / len(losses)


def window(step: int, seq: int) -> int:
    """The window length at ``step``: ``seq // 4``, ``seq // 4``, ``seq // 2``, ``seq``
    in turn."""
    return seq >> (2, 2, 1, 0)[step % 4]


def train(text: str, config: GPTConfig | None = None, steps: int = 3600, batch: int = 8,
          seq: int = 512, lr: float = 3e-3, seed: int = 0, log_every: int = 100,
          log: Callable[[str], Any] | None = print) -> tuple[torch.nn.ModuleDict, dict[str, float]]:
    """Train a model of ``config`` on ``text`` (AdamW, warm-up then cosine decay,
    gradient clipping at 1) for ``steps`` steps of ``batch * seq`` tokens (in
    windows of :func:`window` tokens), all drawn from ``seed``. Returns the model
    (float32) and
    ``{"train_loss", "val_loss", "seconds", "tokens"}`` (losses in nats per token,
    a token being a byte of text, or BOS/EOS)."""
    import torch

    config = config or GPTConfig()
    if seq > config.max_seq:
        raise ValueError(f"seq ({seq}) must be at most max_seq ({config.max_seq})")
    paras = paragraphs(text)
    held = max(1, len(paras) // 20)
    train_stream, train_starts = _stream(paras[:-held])
    val_stream, val_starts = _stream(paras[-held:])
    # windows must fit: pad each stream's end with its own start (never a target that matters)
    train_stream = torch.cat([train_stream, train_stream[:seq + 1]])
    val_stream = torch.cat([val_stream, val_stream[:seq + 1]])
    val = _windows(val_stream, val_starts[:: max(1, len(val_starts) // 64)][:64], seq)
    module = init_module(config, seed).train()
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in module.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in module.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    t0 = time.perf_counter()
    recent: list[float] = []
    for step in range(1, steps + 1):
        scale = step / warmup if step <= warmup else \
            0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        n = window(step, seq)
        pick = train_starts[torch.randint(len(train_starts), (batch * seq // n,), generator=gen)]
        loss = _loss(module, config, _windows(train_stream, pick, n))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        recent = [*recent[-49:], loss.item()]
        if log is not None and (step % log_every == 0 or step == steps):
            log(f"step {step}/{steps}  loss {sum(recent) / len(recent):.3f}  "
                f"{time.perf_counter() - t0:.0f} s")
    seconds = time.perf_counter() - t0
    module.eval()
    stats = {"train_loss": sum(recent) / len(recent), "val_loss": _evaluate(module, config, val),
             "seconds": seconds, "tokens": float(steps * batch * seq)}
    return module, stats


def save_half(module: torch.nn.ModuleDict, path: str | Path) -> Path:
    """The state dict in float16 (TinyGPT converts it to its dtype when it loads)."""
    import torch

    return save_atomic({k: v.detach().to(torch.float16).contiguous()
                        for k, v in module.state_dict().items()}, path)


def _cpu() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python -m mtq.reference.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=CORPUS, help="the training text")
    ap.add_argument("--out", type=Path, default=TRAINED_WEIGHTS, help="the weights file")
    ap.add_argument("--steps", type=int, default=3600)
    ap.add_argument("--batch", type=int, default=8, help="windows per step at full length")
    ap.add_argument("--seq", type=int, default=512, help="tokens of the longest windows")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--d-model", type=int, default=GPTConfig().d_model)
    ap.add_argument("--n-layer", type=int, default=GPTConfig().n_layer)
    ap.add_argument("--n-head", type=int, default=GPTConfig().n_head)
    args = ap.parse_args(argv)
    if not args.corpus.is_file():
        ap.error(f"no corpus at {args.corpus}: run from a checkout of the repository, or "
                 "pass --corpus")
    torch.set_num_threads(args.threads)
    config = GPTConfig(d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head)
    n_params = sum(p.numel() for p in init_module(config).parameters())
    print(f"{config}: {n_params:,} parameters; {args.steps} steps of {args.batch} x "
          f"{args.seq} tokens; seed {args.seed}; {args.threads} threads; torch {torch.__version__} on "
          f"{_cpu()} ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
    module, stats = train(args.corpus.read_text(encoding="utf-8"), config, args.steps,
                          args.batch, args.seq, args.lr, args.seed)
    path = save_half(module, args.out)
    print(f"wrote {path} ({path.stat().st_size:,} bytes) in {stats['seconds']:.0f} s: "
          f"train loss {stats['train_loss']:.3f}, held-out loss {stats['val_loss']:.3f} "
          f"nats/token, {stats['tokens']:,.0f} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
