"""The arbiter's rules and its memory, pure logic over the `Host` protocol.

What lives here: the vocabulary (model), the configuration, the ledger and its
format, the one way to open a state file (files), the rules (planner), carrying
plans out (arbiter, releasing), who is stranded (liveness), the event
vocabulary, and the Host protocol itself (host).  What it may import: itself,
`errors` and `logsetup`; never `host/`, `libvirt/`, `ops/`, `compose` or `cli/`
(tests/test_layers.py checks it).  Nothing here touches sysfs, /proc, libvirt
or a command: every outside effect goes through the `Host` it is given.
"""
