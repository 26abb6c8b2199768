"""The tune search and its report: pure (no ranks, no storage), shared by the light parent
(`launch/tune.py`) and the ranks (`rank/tune_trials.py`)."""
