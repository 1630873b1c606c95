"""
Run the eSpeak NG engine as a Rhapsode worker: python -m rhapsode_engine_espeak.
"""

from rhapsode_worker import serve

from rhapsode_engine_espeak import EspeakEngine

if __name__ == "__main__":
    serve(EspeakEngine)
