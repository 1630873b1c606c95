"""
Run the tone engine as a Rhapsode worker: python -m rhapsode_engine_tone.
"""

from rhapsode_worker import serve

from rhapsode_engine_tone import ToneEngine

if __name__ == "__main__":
    serve(ToneEngine)
