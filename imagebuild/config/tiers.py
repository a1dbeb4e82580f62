"""The smoke suite's tiers (smoke_tests/): what `imagebuild test --tier` and a release file's smoke gate name."""
from __future__ import annotations

TIERS = ("abi", "gpu")  # abi: anywhere, no GPU; gpu: run_check() and a training step on a GPU host
