"""
Run the Kokoro engine as a Rhapsode worker: python -m rhapsode_engine_kokoro.
"""

from rhapsode_worker import serve

from rhapsode_engine_kokoro import KokoroEngine

if __name__ == "__main__":
    serve(KokoroEngine)
