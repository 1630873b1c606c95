"""
What C{twistd rhapsode} runs: options, validated in C{postOptions}, and the service.
"""

from __future__ import annotations

from typing import Any

from twisted.python import usage

from ._config import ConfigError, load_config


class Options(usage.Options):
    """
    C{twistd rhapsode [--config FILE] [--unset KEY ...]}: without a file, every default and
    no engines.  C{--unset KEY} drops a setting saved in the state database before the
    start reads it, for a saved value a start cannot apply (the API's
    C{rhapsode settings KEY --unset} needs a server that runs).
    """

    optParameters = [["config", "c", None, "Path of the JSON config file."]]

    def __init__(self) -> None:
        super().__init__()
        self["unset"] = []

    def opt_unset(self, key: str) -> None:
        """
        Drop the setting KEY (a dotted key, e.g. server.host) from the state database
        before starting; may be given more than once.
        """
        self["unset"].append(key)

    def postOptions(self) -> None:
        try:
            self["loaded"] = load_config(self["config"])
        except (ConfigError, OSError) as error:
            raise usage.UsageError(str(error)) from None


#: The services made here, so that C{rhapsode serve} can tell how its run ended.
made: list[Any] = []


def makeService(options: Options) -> Any:
    from ._service import RhapsodeService

    # Under twistd a port that cannot be bound ends the process, with the reason logged.
    # The state database lives beside the config file it names.
    service = RhapsodeService(
        options["loaded"], stop_reactor_if_unable=True, config_path=options["config"], unset=options["unset"]
    )
    made.append(service)
    return service
