"""Make this folder's helpers importable and load the plans on the main thread.

Plans register themselves on first use; doing that here keeps the rank threads of
``run_threaded`` from racing on the plugin import.
"""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (str(_HERE.parents[1]), str(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import gradshard as gs  # noqa: E402

gs.plans()
