"""
Run the Chatterbox engine as a Rhapsode worker: python -m rhapsode_engine_chatterbox.
"""

from rhapsode_worker import serve

from rhapsode_engine_chatterbox import ChatterboxEngine

if __name__ == "__main__":
    serve(ChatterboxEngine)
