"""
The core as a library: a Twisted service a program adds to its application, and the
config it runs from.

    from rhapsode.service import RhapsodeService, load_config

    core = RhapsodeService(load_config("rhapsode.json"))
    core.setServiceParent(application)            # or core.startService()
    address = await core.when_listening()         # in a coroutine: where the public API answers

(README.md has this as a whole program, run on twisted's C{react}.)

It is what C{twistd rhapsode} runs.  Stopping the service stops listening, lets requests
in flight finish (C{server.shutdownGraceMs}) and ends every worker it spawned.  Speak
to it with L{rhapsode.client}.
"""

from ._config import Config, ConfigError, EngineConfig, load_config, parse_config
from ._service import RhapsodeService

__all__ = ["Config", "ConfigError", "EngineConfig", "RhapsodeService", "load_config", "parse_config"]
