"""The run's lifecycle: its folder, lock and status (folder.py), the stop signals (stop.py), the
failure protocol that makes every rank end alike (protocol.py), where the run is (state.py), its
metrics, curves and human lines (metrics.py, tracking.py)."""
