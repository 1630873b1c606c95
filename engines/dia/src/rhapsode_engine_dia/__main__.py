"""
Run the Dia engine as a Rhapsode worker: python -m rhapsode_engine_dia.
"""

from rhapsode_worker import serve

from rhapsode_engine_dia import DiaEngine

if __name__ == "__main__":
    serve(DiaEngine)
