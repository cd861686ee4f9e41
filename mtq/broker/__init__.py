"""Everything that touches Redis: key names, Lua scripts, connections, the embedded server."""
