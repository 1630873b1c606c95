"""
A worker that never hand-shakes: it says one thing on stderr and sleeps, as one stuck
importing a framework would.  Run as C{python -m mute_worker} with this folder on
PYTHONPATH.
"""

import sys
import time

if __name__ == "__main__":
    sys.stderr.write("mute worker: warming up forever\n")
    sys.stderr.flush()
    time.sleep(60)
