"""charly-arbiter: arbitrates GPUs between passthrough VMs, containers and host services."""

__version__ = "0.1.0"
