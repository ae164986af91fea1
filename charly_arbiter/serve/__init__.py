"""The resident helper: a fork server that spares each command Python's start.

`charly-arbiter serve` (server.py) starts once, imports the package, click and
the standard library, and listens on a root-only socket.  Per request it forks a
fresh child (child.py) that takes over the client's stdin, stdout and stderr,
its arguments, environment and working directory, and runs the very `main(argv)`
the client would have run, so every command keeps its semantics; the exit status
goes back to the client.  client.py is the other half, in the program's own path
before anything heavy is imported: it hands the command over, or says the helper
is not there (stopped, dead, hung, late) and the command runs in-process as
without it.  docs/architecture.md ("Where people wait") says why and what it
costs.  What it may import: itself and the bottom modules (`errors`, `logsetup`);
the program's `main` is handed to it, never imported (tests/test_layers.py).
"""
