"""The example chat page (chat.html) served by FastAPI, Flask and Django.

Each app submits :func:`chat_payload`: ``{"prompt", "max_tokens"}``, which mtq's
reference TinyGPT and ``hf:CausalLM`` both take, or with ``MTQ_CHAT_MESSAGES=1`` the
prompt as one user message, which ``hf:CausalLM`` renders with its model's chat
template (an instruct model then answers it as a chat)::

    mtq workers start mtq.reference.gpt:TinyGPT --queue chat
    MTQ_CHAT_MESSAGES=1 ... mtq workers start hf:CausalLM --queue chat \\
        --set model=Qwen/Qwen2.5-0.5B-Instruct
"""

from __future__ import annotations

import os
from typing import Any


def chat_payload(prompt: str, max_tokens: int) -> dict[str, Any]:
    """The task payload of one request of the page (see the module doc)."""
    if os.environ.get("MTQ_CHAT_MESSAGES", "").lower() in ("1", "true", "yes", "on"):
        return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    return {"prompt": prompt, "max_tokens": max_tokens}
