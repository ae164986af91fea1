"""`charly-arbiter hook oci-inject BUNDLE [--hook=PATH] [--engine=NAME]`: the runtime
wrapper's half, for engines that read no hooks.d (Docker).

hooks/oci-runtime stands in for runc (registered as a runtime in Docker's
daemon.json); before `runc create` it runs this, which adds charly-arbiter's
OCI hook to the bundle's config.json as a prestart and a poststop hook, the way
NVIDIA's container runtime adds its own, and then runs runc itself with the
same arguments.  From there on the container claims and releases exactly as
under Podman.  The spec is replaced in one step (a temporary file renamed over
it); a spec that already has the hook is left as it is.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from charly_arbiter.core import files

USAGE = "usage: charly-arbiter hook oci-inject BUNDLE [--hook=PATH] [--engine=NAME]"
DEFAULT_HOOK = "/usr/libexec/charly-arbiter/oci-hook"
STAGES = ("prestart", "poststop")
MAX_SPEC = 16 << 20


def main(argv: list[str]) -> int:
    hook, engine, bundle = DEFAULT_HOOK, "docker", None
    for argument in argv:
        if argument.startswith("--hook="):
            hook = argument.partition("=")[2]
        elif argument.startswith("--engine="):
            engine = argument.partition("=")[2]
        elif bundle is None and not argument.startswith("-"):
            bundle = argument
        else:
            bundle = None
            break
    if bundle is None or not hook.startswith("/") or not engine.isidentifier():
        print(f"charly-arbiter: {USAGE}", file=sys.stderr)
        return 2
    try:
        inject(Path(bundle), hook, engine)
    except (OSError, ValueError) as error:
        print(
            f"charly-arbiter: cannot add the OCI hook to {bundle}/config.json: {error}.",
            file=sys.stderr,
        )
        return 1
    return 0


def inject(bundle: Path, hook: str, engine: str) -> bool:
    """Add the hook at both stages; False when the spec has it already."""
    path = bundle / "config.json"
    info = os.stat(path)
    with open(path, "rb") as handle:
        data = handle.read(MAX_SPEC + 1)
    if len(data) > MAX_SPEC:
        raise ValueError(f"larger than {MAX_SPEC >> 20} MiB")
    spec: Any = json.loads(data)
    if not isinstance(spec, dict):
        raise ValueError("not a JSON object")
    hooks = spec.setdefault("hooks", {})
    if not isinstance(hooks, dict):
        raise ValueError("its hooks are not an object")
    entry = {"path": hook, "args": ["oci-hook", f"--engine={engine}"]}
    changed = False
    for stage in STAGES:
        listed = hooks.setdefault(stage, [])
        if not isinstance(listed, list):
            raise ValueError(f"its {stage} hooks are not a list")
        if not any(isinstance(item, dict) and item.get("path") == hook for item in listed):
            # Ours first at prestart (a refusal then stops the start before any other
            # hook touches the GPU), last at poststop.
            listed.insert(0, entry) if stage == "prestart" else listed.append(entry)
            changed = True
    if changed:
        temp = path.with_name(f".config.json.{os.getpid()}.tmp")
        temp.unlink(missing_ok=True)
        files.replace_file(
            path,
            json.dumps(spec, separators=(",", ":")).encode(),
            temp=temp,
            mode=info.st_mode & 0o7777,
            durable=False,
        )
    return changed
