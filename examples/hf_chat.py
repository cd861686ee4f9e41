"""Chat in the terminal with a Hugging Face causal LM served by mtq (``hf:CausalLM``).

    python -m examples.hf_chat /path/to/model       # a folder saved with save_pretrained
    python -m examples.hf_chat Qwen/Qwen2.5-0.5B-Instruct

The second form downloads the model from the Hugging Face hub once (about 1 GB, into
the Hugging Face cache; ``pip install 'mtq[hf]'``, and HF_HUB_OFFLINE unset); offline,
give a local folder. The script starts a worker for its own queue::

    mtq workers start hf:CausalLM --queue QUEUE --set model=MODEL --devices DEVICE

then reads your lines, submits the conversation so far as ``{"messages": [...]}`` (the
model's chat template renders it) and prints the reply's text pieces as they stream.
An empty line or Ctrl-D ends the chat, and the worker with it. ``--prompt TEXT``
asks one question without reading the terminal. Redis: ``--redis URL``, else
``MTQ_REDIS_URL``, else mtq's embedded server (the worker uses the same).

Options: ``--max-tokens`` (256), ``--temperature`` (0.7), ``--seed``, ``--system``
(a system message), ``--devices`` (``all``: the GPUs if any), ``--set KEY=VALUE``
(more worker options, e.g. ``dtype=float32`` or ``chat_template=FILE``; see
``mtq models`` and docs/models.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import mtq
from mtq.workers.registry import list_workers

#: longest wait for the worker to load the model (a first hub download may be slow)
READY_S = 600.0


def start_worker(model: str, queue: str, url: str | None, devices: str,
                 sets: Sequence[str]) -> subprocess.Popen[bytes]:
    """``mtq workers start hf:CausalLM`` for ``queue``, its output on this terminal's stderr."""
    cmd = [sys.executable, "-m", "mtq", "workers", "start", "hf:CausalLM", "--queue", queue,
           "--devices", devices, "--replicas", "1", "--standby", "0", "--set", f"model={model}"]
    for s in sets:
        cmd += ["--set", s]
    if url:
        cmd += ["--redis", url]
    return subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)


def wait_ready(q: mtq.Queue, worker: subprocess.Popen[bytes], timeout: float = READY_S) -> None:
    deadline = time.monotonic() + timeout
    while not list_workers(q.redis, q.name):
        if worker.poll() is not None:
            raise SystemExit(f"the worker exited ({worker.returncode}): see its output above")
        if time.monotonic() > deadline:
            raise SystemExit(f"no worker was ready after {timeout:.0f} s")
        time.sleep(0.2)


def ask(q: mtq.Queue, messages: list[dict[str, str]], args: argparse.Namespace) -> str:
    """Submit the chat, print the reply as it streams, return its text."""
    payload: dict[str, Any] = {"messages": messages, "max_tokens": args.max_tokens,
                               "temperature": args.temperature}
    if args.seed is not None:
        payload["seed"] = args.seed
    task = q.submit(payload)
    for piece in task.tokens(timeout=300):
        print(piece, end="", flush=True)
    result = task.result(timeout=30)
    print(f"\n[{result['finish_reason']}, {result['usage']['completion_tokens']} tokens]",
          flush=True)
    return str(result["text"])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("model", help="a local model folder, or a hub name")
    ap.add_argument("--prompt", help="ask this once and exit (no terminal input)")
    ap.add_argument("--system", help="a system message first in the chat")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--devices", default="cpu", help="cpu (default), cuda:0, all, ...")
    ap.add_argument("--redis", default=os.environ.get("MTQ_REDIS_URL"))
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)

    q = mtq.Queue(f"hf-chat-{uuid.uuid4().hex[:8]}", args.redis)
    worker = start_worker(args.model, q.name, args.redis, args.devices, args.sets)
    try:
        print(f"loading {args.model} ...", file=sys.stderr, flush=True)
        wait_ready(q, worker)
        messages = [{"role": "system", "content": args.system}] if args.system else []
        while True:
            if args.prompt is not None:
                line = args.prompt
            else:
                try:
                    line = input("you> ").strip()
                except EOFError:
                    line = ""
            if not line:
                break
            messages.append({"role": "user", "content": line})
            print("model> ", end="", flush=True)
            messages.append({"role": "assistant", "content": ask(q, messages, args)})
            if args.prompt is not None:
                break
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)  # a graceful stop of the supervisor
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(10)
        q.delete(force=True)  # the chat's own queue: its tasks, streams and name
    return 0


if __name__ == "__main__":
    sys.exit(main())
