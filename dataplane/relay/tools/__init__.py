"""Tool calls across a seam: Baton runs the backend's declared tool parser itself over the
text of the ids it holds (parsers.py names them), and shows the calls as chat deltas that
continue what the client already has (follow.py)."""
