"""Make the repository root (``import examples``) and this folder's helpers importable."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (str(_HERE.parents[1]), str(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
