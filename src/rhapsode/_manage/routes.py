"""
The management routes (protocol.md sections 9 and 10): settings, installing, reinstalling,
pulling and uninstalling engines as jobs with their event streams, and the update check.

Every route but the update check is guarded at its head (L{rhapsode._http.site}) and
refuses here too should it be reached any other way.  Without a state database a core
keeps no settings and installs nothing, and these routes say so (C{unsupported}).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from twisted.logger import Logger
from twisted.web.iweb import IRequest

from rhapsode_protocol.errors import BadRequest, SpeechError, Unsupported
from rhapsode_protocol.http.answers import InFlight, answer, error_response, json_response
from rhapsode_protocol.validation import TooDeep, loads_json

from .._http.site import require_guard
from .installer import Installer, install_query
from .jobs import Jobs, last_event_id
from .settings import Settings, caller_of, read_patch
from .update import UpdateChecker

__all__ = ["ManagementRoutes"]


class ManagementRoutes:
    """
    The routes of sections 9 and 10 over the core's jobs, installer, settings and
    update check.

    @param installer: makes install, reinstall and pull jobs; without one every install
        route answers unsupported.
    @param settings: the settings and the state database they live in; without one,
        /settings answers unsupported (a core embedded without a config file has
        nowhere to keep one).
    """

    log = Logger()

    def __init__(
        self,
        *,
        jobs: Jobs,
        updates: UpdateChecker,
        requests: InFlight,
        installer: Installer | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.jobs = jobs
        self.updates = updates
        self.requests = requests
        self.installer = installer
        self.settings = settings

    def handlers(self) -> dict[str, Callable[..., Any]]:
        """
        The handlers of the table's management routes, by name.
        """
        return {
            "get_settings": self._get_settings,
            "patch_settings": self._patch_settings,
            "install": self._install,
            "reinstall": self._reinstall,
            "outdated": self._outdated,
            "pull": self._pull,
            "uninstall": self._uninstall,
            "jobs": self._jobs,
            "job": self._job,
            "job_events": self._job_events,
            "update": self._update,
            "update_check": self._update_check,
        }

    async def _answer(self, request: IRequest, handler: Callable[[], Awaitable[Any]]) -> Any:
        return await answer(request, handler, self.log, self.requests.enter, self.requests.leave)

    # -- settings: guarded at their heads, reading included -------------------------------

    def _settings_or_refuse(self, request: IRequest) -> Settings:
        require_guard(request)
        if self.settings is None:
            raise Unsupported("this server has no state database to keep settings in (it was started without a config file)")
        return self.settings

    async def _get_settings(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            return json_response(request, 200, self._settings_or_refuse(request).document())

        return await self._answer(request, handle)

    async def _patch_settings(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            settings = self._settings_or_refuse(request)
            request.content.seek(0)
            document = await settings.patch(read_patch(request.content.read()), caller_of(request))
            return json_response(request, 200, document)

        return await self._answer(request, handle)

    # -- installing: guarded at their heads ----------------------------------------------

    def _installer_or_refuse(self, request: IRequest) -> Installer:
        require_guard(request)
        if self.installer is None:
            raise Unsupported("this server cannot install engines (it was started without a state database)")
        return self.installer

    def _job_answer(self, request: IRequest, document: dict[str, Any]) -> bytes:
        request.setHeader(b"Location", f"/installs/{document['id']}".encode())
        return json_response(request, 202, document)

    async def _install(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            installer = self._installer_or_refuse(request)
            query = install_query(request.args or {}, ("pull", "accept"))
            job = installer.install(engine_id, query["pull"], query["accept"])
            return self._job_answer(request, job.document())

        return await self._answer(request, handle)

    async def _reinstall(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            installer = self._installer_or_refuse(request)
            query = install_query(request.args or {}, ("accept",))
            return self._job_answer(request, installer.reinstall(engine_id, query["accept"]).document())

        return await self._answer(request, handle)

    async def _outdated(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            installer = self._installer_or_refuse(request)
            install_query(request.args or {}, ())
            return json_response(request, 202, installer.outdated())

        return await self._answer(request, handle)

    async def _pull(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            installer = self._installer_or_refuse(request)
            request.content.seek(0)
            try:
                body = loads_json(request.content.read() or b"null")
            except TooDeep:
                raise
            except ValueError as error:
                raise BadRequest(f"the body is not JSON: {error}", field="body") from None
            return self._job_answer(request, installer.pull(engine_id, body).document())

        return await self._answer(request, handle)

    async def _uninstall(self, request: IRequest, engine_id: str) -> Any:
        async def handle() -> bytes:
            installer = self._installer_or_refuse(request)
            await installer.uninstall(engine_id)
            request.setResponseCode(204)
            return b""

        return await self._answer(request, handle)

    async def _jobs(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            require_guard(request)
            return json_response(request, 200, self.jobs.documents(self.jobs.all()))

        return await self._answer(request, handle)

    async def _job(self, request: IRequest, job_id: str) -> Any:
        async def handle() -> bytes:
            require_guard(request)
            return json_response(request, 200, self.jobs.get(job_id).document())

        return await self._answer(request, handle)

    def _job_events(self, request: IRequest, job_id: str) -> Any:
        # Not through _answer: a stream that follows a job is not a request in flight
        # for a shutdown to wait on (the shutdown ends it).
        try:
            require_guard(request)
            job = self.jobs.get(job_id)
            cursor = last_event_id(request)
            return self.jobs.open_stream(request, job, cursor)
        except SpeechError as error:
            return error_response(request, error)

    # -- the update check (protocol.md section 9): open to every caller ----------------

    def _update(self, request: IRequest) -> bytes:
        # Never waits: at most it starts one check in the background.
        return json_response(request, 200, self.updates.status())

    async def _update_check(self, request: IRequest) -> Any:
        async def handle() -> bytes:
            request.content.seek(0)
            body = request.content.read().strip()
            if body and body != b"{}":
                raise BadRequest("POST /update/check takes no body", field="body")
            return json_response(request, 200, await self.updates.check_now())

        return await self._answer(request, handle)
