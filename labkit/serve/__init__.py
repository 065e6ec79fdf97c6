"""labkit.serve: the engine behind an OpenAI-compatible HTTP API, and a client that replays a trace against any such server."""
