"""Wiring of the control plane, in the order it is put together:

- `build.py`: the parts as configured: the audit log (restored from disk), the registry (the
  config file's fleet with what operators changed at run time laid over it), the gRPC server
  with its services registered;
- `part.py`: a replica's part as the routing service and the leader gate ask it (the null
  standalone one, or a joined replica's);
- `pending.py`: pairs waiting for both backends' facts, bound as they come;
- `scrape.py`: Prometheus's /metrics over plain HTTP;
- `plane.py`: `ControlPlane`, which owns them and the background tasks: `start` binds, `stop`
  shuts down gracefully."""

from control.server.plane import ControlPlane

__all__ = ["ControlPlane"]
