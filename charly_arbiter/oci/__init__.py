"""OCI hooks: containers (Podman, CRI-O, any runtime with hooks.d) claim by themselves.

What lives here: `hook` (the runtime's entry point: the state on stdin, the
stdout guard and the error boundary; for a container given no character device
and naming no CDI device it imports `json` and nothing of the arbiter), `spec`
(what a container is given and what it is called, from its state and its
bundle's config.json), `hookrun` (the slow path: claim at creation, release at
stop) and `inject` (the runtime wrapper's half for engines without hooks.d:
Docker).  What it may import: `core/`, `host/`, `compose` and `ops/`; never
`cli/` or `libvirt/`.
"""
