"""The resident engine: a local process that keeps models loaded, so that `refusion generate` and `refusion chat`
answer without paying for Python, torch and the model at every command.

    command (client.py: the standard library only) --HTTP over a unix socket--> engine (process.py)
                                                                                  one `serve.create_app` per model

The engine is the server of `refusion serve` (its app, scheduler and decoder), reached through a unix socket in an
owner-only directory (`place.py`) instead of a TCP port. The first command that needs it starts it; it unloads a
model after the model's keep-alive (`--keep-alive`, `REFUSION_KEEP_ALIVE`, default 5 minutes) and exits when it
holds none. `refusion ps` lists what it holds, `refusion stop` ends it after its running answers.
"""
