"""Run the remote engine as a Rhapsode worker: python -m rhapsode_engine_remote."""

from rhapsode_worker import serve

from rhapsode_engine_remote import RemoteEngine

if __name__ == "__main__":
    serve(RemoteEngine)
