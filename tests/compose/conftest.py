"""Make the chunked tests' model module importable (``chunked_models``) from this folder."""

import sys
from pathlib import Path

_CHUNKED = str(Path(__file__).resolve().parents[1] / "chunked")
if _CHUNKED not in sys.path:
    sys.path.insert(0, _CHUNKED)
