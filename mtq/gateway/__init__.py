"""mtq's OpenAI-compatible HTTP gateway (``mtq serve``) and its API keys
(:mod:`mtq.gateway.keys`). Importing the package loads nothing heavy: the web server's
modules are imported by what needs them."""
