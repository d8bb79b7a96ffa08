"""The run's lifecycle: its folder, lock and status (folder.py), the stop signals (stop.py), the
failure protocol that makes every rank end alike (protocol.py), where the run is (state.py), its
metrics, curves and human lines (metrics.py, tracking.py), and a live-recovery group's part: each step's batch
after the quorum, the heal from a peer, verified, and the writer group (live.py)."""
