"""libvirt: the qemu hook, the domain XML, and domains as holders.

What lives here: `hook` (libvirt's entry point: argv, the byte scan, the stdout
guard and the error boundary; it imports nothing else until a domain may claim
a GPU), `hookrun` (the slow path, with normal imports), `domainxml` (claims from
<hostdev> and <metadata>) and `domains` (holder VMs, found by the same rules;
the domain a hook is about is passed in, never read from the environment).
What it may import: `core/`, `host/`, `compose` and `ops/`; never `cli/`.
"""
