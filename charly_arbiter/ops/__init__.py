"""What operators see and keep: events, history, explanations, metrics, checks.

What lives here: where events go (`eventlog`: the history file, the journal, a
terminal's progress line), the history itself, `explain`, Prometheus `metrics`,
the host checks of `doctor`, and `recovery` from a corrupt ledger.  What it may
import: `core/` and `host/`; never `libvirt/`'s hook, `compose` or `cli/`.
"""
