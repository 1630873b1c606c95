"""
Run the Piper engine as a Rhapsode worker: python -m rhapsode_engine_piper.
"""

from rhapsode_worker import serve

from rhapsode_engine_piper import PiperEngine

if __name__ == "__main__":
    serve(PiperEngine)
