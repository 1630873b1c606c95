"""
The residency manager (protocol.md section 3): which engines' models hold the card,
for how long, and which one goes when another needs the room.

Separate from the router, it decides and the router acts.  Every stream takes a
L{Lease} on its engine's model for as long as it runs, and a leased model is never
evicted or expired under its caller.  A model that needs room takes it from the least
recently used model without a lease, by terminating that model's worker; when every
resident model is leased it waits, up to C{evictionWaitSeconds}, for one to let go.
An idle model is terminated when its keep-alive runs out.

A model served elsewhere (a variant whose capability names a C{remote} server) is
leased as any other, so /residency shows who speaks with it and through which server,
but it holds no room here: it is not counted against C{maxResidentModels}, never evicted,
never expired (terminating the worker that calls it would free nothing) and never the
reason a local model waits.  Each such variant is its own entry, since each is a model
of its own on a server of its own; unloading one is unsupported, which is the truth.

Admissions, evictions, expiries and unloads are serialised by one lock, so an unload
cannot slip between an admission decision and the lease it grants.  The lock is held
while a worker is being terminated (the card is not free until it has gone), and never
while an acquire waits for a lease to end.  Every setting is read when it is used,
through L{IResidencySettings}, so a settings API can change them while the core runs.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from datetime import datetime, timezone
from typing import Any, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from rhapsode_protocol.errors import BadRequest, Conflict, ModelUnavailable, SpeechError, Unsupported

from .._interfaces import IResidencySettings

_T = TypeVar("_T")

#: How an operator may give a model's memory back (POST /engines/{engine}/unload).
UNLOAD_MODES = ("terminate", "unload")


class _Turns:
    """
    A lock handed from one holder to the next without nesting.

    Twisted's DeferredLock wakes the next waiter inside C{release}; a waiter that finishes
    at once releases inside that, and so on, one stack frame deeper per waiter: a burst
    of a few hundred requests queued behind an eviction ran out of stack, and every
    request after the sixtieth or so was never answered.  Here a release made while
    handing the lock on is noted and the hand-over loop goes round again instead.
    """

    def __init__(self) -> None:
        self.locked = False
        self._waiting: deque[Deferred[None]] = deque()
        self._handing = False
        self._released_again = False

    def acquire(self) -> "Deferred[None]":
        waiter: Deferred[None] = Deferred(self._waiting.remove)
        if self.locked:
            self._waiting.append(waiter)
        else:
            self.locked = True
            waiter.callback(None)
        return waiter

    def release(self) -> None:
        if self._handing:
            self._released_again = True
            return
        self._handing = True
        try:
            while True:
                if not self._waiting:
                    self.locked = False
                    return
                self._released_again = False
                # The lock passes straight to the next waiter: it stays locked.
                self._waiting.popleft().callback(None)
                if not self._released_again:
                    return
        finally:
            self._handing = False


def iso_utc(seconds: float) -> str:
    """
    A clock reading as ISO 8601 in UTC with milliseconds and a Z.
    """
    millis = round(seconds * 1000)
    moment = datetime.fromtimestamp(millis // 1000, timezone.utc)
    return f"{moment:%Y-%m-%dT%H:%M:%S}.{millis % 1000:03d}Z"


class _Model:
    """
    One resident model.

    @ivar asked: the keep-alive the request that last took a lease gave, C{None} if
        it gave none (the engine's own value then applies).
    @ivar expiry: the call that ends this model's keep-alive once it is idle; it may
        come due early (the model was leased since), and then sets itself again.
    """

    def __init__(self, engine: str, variant: str) -> None:
        self.engine = engine
        self.variant = variant
        self.leases = 0
        self.last_used = 0.0
        self.asked: int | None = None
        self.size_bytes: int | None = None
        #: Whether the worker has been asked what this load cost (it may not know).
        self.measured = False
        #: Whether the worker has answered a request in this variant, so has loaded it:
        #: until then the model is admitted, and loading.
        self.loaded = False
        #: When it was admitted to load (for how long the load took).
        self.admitted = 0.0
        self.expiry: IDelayedCall | None = None
        #: Where a model served elsewhere runs; None for one on this box.
        self.server: str | None = None

    def disarm(self) -> None:
        if self.expiry is not None:
            if self.expiry.active():
                self.expiry.cancel()
            self.expiry = None


class Lease:
    """
    One stream's hold on its engine's model.  Release it when the stream ends, however
    it ends; releasing twice is harmless.
    """

    def __init__(self, residency: Residency, model: _Model) -> None:
        self._residency = residency
        self._model: _Model | None = model
        self.engine = model.engine
        self.variant = model.variant

    def release(self) -> None:
        model, self._model = self._model, None
        if model is not None:
            self._residency._released(model)


class _Ticket:
    """
    One acquire on its way to a lease.

    @ivar gone: its caller has stopped waiting (or it is finished), so nothing may be
        granted to it any more.
    @ivar give_up_at: when it fails, set the first time every model it could use was
        leased, C{patience} seconds before.
    @ivar blocked: why it is waiting.
    """

    def __init__(self, engine: str, variant: str, keep_alive: int | None) -> None:
        self.engine = engine
        self.variant = variant
        self.keep_alive = keep_alive
        self.gone = False
        self.give_up_at: float | None = None
        self.patience = 0.0
        self.blocked = ""


#: What L{Residency._if_quiet} answers when the engine holds a lease.
_SPEAKING = object()


class Residency:
    """
    The models resident on the card, their leases and deadlines.

    @param clock: the time source for deadlines, waits and timestamps.
    @param settings: read each time a value is used.
    @param terminate: ends an engine's worker process (the terminate verb, then a
        signal); fires once it has gone.  It must fire, one way or another, in bounded
        time: admissions wait for it.
    @param unload: unloads an engine's model and keeps its process; fires once done.
    """

    log = Logger()

    def __init__(
        self,
        *,
        clock: IReactorTime,
        settings: IResidencySettings,
        terminate: Callable[[str], Deferred[Any]],
        unload: Callable[[str], Deferred[Any]],
    ) -> None:
        self._clock = clock
        self._settings = settings
        self._terminate = terminate
        self._unload = unload
        self._lock = _Turns()
        # Least recently used first: the order evictions take them in.
        self._models: OrderedDict[str, _Model] = OrderedDict()
        #: Models served elsewhere, by engine and variant: outside every budget.
        self._remote: dict[tuple[str, str], _Model] = {}
        self._tickets: list[_Ticket] = []
        self._room: list[Deferred[bool]] = []
        #: Told of loads and evictions (the core's metrics); None tells nobody.
        self.observer: Any = None

    # -- what the router calls ----------------------------------------------------------

    async def acquire(
        self, engine: str, variant: str, keep_alive: int | None = None, server: str | None = None
    ) -> Lease:
        """
        A lease on C{engine}'s model in C{variant}, making it resident if it is not.

        Evicts the least recently used model without a lease when the budget is full,
        and waits for a lease to end when every resident model has one, or when the
        engine is speaking another variant.  A caller that cancels stops waiting and
        takes nothing (an eviction already under way still finishes).

        @param keep_alive: the request's C{keepAliveSeconds}, C{None} if it gave none.
        @param server: where C{variant}'s model is served, for one served elsewhere: it
            is leased at once, outside the budget, and waits on nothing.
        @raise ModelUnavailable: no room came within C{evictionWaitSeconds}.
        """
        if server is not None:
            return self._remote_lease(engine, variant, server)
        model = self._models.get(engine)
        if model is not None and model.variant == variant and not self._lock.locked:
            # What the lock would decide at once, without the round trip through it: the
            # common case of a model already resident in the variant asked for.
            return self._lease(model, keep_alive)
        ticket = _Ticket(engine, variant, keep_alive)
        self._tickets.append(ticket)
        try:
            while True:
                lease = await self._exclusively(lambda: self._admit(ticket))
                if lease is not None:
                    return lease
                await self._wait_for_room(ticket)
        finally:
            ticket.gone = True
            self._tickets.remove(ticket)

    async def unload(self, engine: str, mode: str = "terminate") -> None:
        """
        Give C{engine}'s memory back now: C{terminate} ends its worker process, C{unload}
        keeps the process for a faster next load.  Idempotent: with nothing resident the
        action is still taken (a terminate still ends the process).

        @raise Conflict: the engine is speaking.
        @raise BadRequest: C{mode} is neither.
        """
        if mode not in UNLOAD_MODES:
            raise BadRequest(f'mode must be terminate or unload, not "{mode}"', field="mode")
        served = self.served_elsewhere(engine)
        if served:
            raise served_elsewhere_refusal(engine, served)
        await self._exclusively(lambda: self._unload_now(engine, mode))

    async def quiet(self, engine: str, work: Callable[[], Coroutine[Any, Any, _T]], wait: float | None) -> _T:
        """
        Run C{work} under the lock a load takes, once C{engine} holds no lease, with its
        model (if one is resident) forgotten first: C{work} replaces or removes the
        engine, and nothing can start speaking on it in between.

        @param wait: how long to wait for the engine to stop speaking; C{None} refuses
            at once instead (an uninstall, whose caller is there to be told).
        @raise Conflict: the engine is speaking, and C{wait} is C{None} or has passed.
        """
        give_up_at = None if wait is None else self._clock.seconds() + wait
        while True:
            outcome = await self._exclusively(lambda: self._if_quiet(engine, work))
            if outcome is not _SPEAKING:
                return outcome
            now = self._clock.seconds()
            if give_up_at is None or now >= give_up_at:
                waited = "" if wait is None else f" after {wait:g} s"
                raise Conflict(f'engine "{engine}" is speaking{waited}; try again once it has finished',
                               field="engine")
            changed: Deferred[bool] = Deferred()
            self._room.append(changed)
            timer = self._clock.callLater(give_up_at - now, changed.callback, False)
            try:
                await changed
            finally:
                if timer.active():
                    timer.cancel()
                if changed in self._room:
                    self._room.remove(changed)

    async def _if_quiet(self, engine: str, work: Callable[[], Coroutine[Any, Any, _T]]) -> Any:
        model = self._models.get(engine)
        if model is not None and model.leases > 0:
            return _SPEAKING
        if model is not None:
            self._drop(model, "unload")
        try:
            return await work()
        finally:
            self._wake()

    def served_elsewhere(self, engine: str) -> dict[str, str]:
        """
        The variants of C{engine} leased as models served elsewhere, with their servers.
        """
        return {variant: model.server or "" for (name, variant), model in self._remote.items() if name == engine}

    def _remote_lease(self, engine: str, variant: str, server: str) -> Lease:
        model = self._remote.get((engine, variant))
        if model is None:
            model = self._remote[(engine, variant)] = _Model(engine, variant)
            model.loaded = True
            self.log.info("{engine} ({variant}) is served by {server}", engine=engine, variant=variant, server=server)
        model.server = server
        model.leases += 1
        model.last_used = self._clock.seconds()
        return Lease(self, model)

    def record_size(self, engine: str, variant: str, size_bytes: int | None) -> None:
        """
        What the worker measured C{variant} took (its C{modelBytes}); ignored unless
        that variant is the one resident.  Zero or less is a failed measurement.
        """
        model = self._models.get(engine)
        if model is not None and model.variant == variant:
            model.size_bytes = size_bytes if size_bytes is not None and size_bytes > 0 else None
            model.measured = True

    def mark_loaded(self, engine: str, variant: str) -> None:
        """
        C{engine}'s worker answered a request in C{variant}: its model is loaded.
        """
        model = self._models.get(engine)
        if model is not None and model.variant == variant:
            if not model.loaded and self.observer is not None:
                self.observer.load_finished(engine, variant, self._clock.seconds() - model.admitted)
            model.loaded = True

    def loaded(self, engine: str) -> bool:
        model = self._models.get(engine)
        return model is not None and model.loaded

    def forget(self, engine: str) -> None:
        """
        C{engine}'s worker process has gone, and its model with it.  Leases still held on
        it end quietly when released.
        """
        model = self._models.get(engine)
        if model is not None:
            self._drop(model, "crash")
            self.log.info("{engine} ({variant}) is no longer resident", engine=engine, variant=model.variant)
            self._wake()

    def settings_changed(self) -> None:
        """
        A residency setting has changed: every idle model's deadline moves to what the
        keep-alive in force now gives, and waiting acquires look again.  A lower budget
        evicts nothing here; the next load that needs the room does.
        """
        for model in list(self._models.values()):
            if model.leases == 0:
                self._arm(model)
        self._wake()

    def state(self, engine: str) -> dict[str, Any]:
        """
        What the manager holds about C{engine}: whether its model is resident, which
        variant, how many streams hold it, and its size where measured.
        """
        state: dict[str, Any]
        model = self._models.get(engine)
        if model is None:
            state = {"resident": False, "leases": 0}
            served = sorted((m for (name, _), m in self._remote.items() if name == engine), key=lambda m: m.last_used)
            if served:
                # Nothing on this box; what is served elsewhere, the last used last.
                state["served"] = {m.variant: m.server for m in served}
                state["leases"] = sum(m.leases for m in served)
            return state
        state = {
            "resident": True,
            "variant": model.variant,
            "leases": model.leases,
            "measured": model.measured,
            "loaded": model.loaded,
        }
        if model.size_bytes is not None:
            state["sizeBytes"] = model.size_bytes
        return state

    def close(self) -> None:
        """
        Stop every keep-alive timer: the core is shutting down and its workers go with it.
        """
        for model in self._models.values():
            model.disarm()

    def snapshot(self) -> dict[str, Any]:
        """
        The C{GET /residency} document, from the manager's own state alone; models in
        eviction order, the next to go first.
        """
        models = []
        for model in self._models.values():
            keep_alive = self._keep_alive(model)
            entry: dict[str, Any] = {
                "engine": model.engine,
                "variant": model.variant,
                "leases": model.leases,
                "lastUsedAt": iso_utc(model.last_used),
            }
            if model.leases == 0 and keep_alive >= 0:
                entry["expiresAt"] = iso_utc(model.last_used + keep_alive)
            entry["keepAliveSeconds"] = keep_alive
            if model.size_bytes is not None:
                entry["sizeBytes"] = model.size_bytes
            models.append(entry)
        for model in sorted(self._remote.values(), key=lambda m: (m.engine, m.variant)):
            models.append({
                "engine": model.engine,
                "variant": model.variant,
                "leases": model.leases,
                "lastUsedAt": iso_utc(model.last_used),
                "keepAliveSeconds": -1,
                "server": model.server,
            })
        return {
            "resident": len(self._models),
            "max": self._settings.max_resident_models(),
            "waiting": len(self._tickets),
            "models": models,
        }

    # -- under the lock -------------------------------------------------------------------

    async def _exclusively(self, work: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        """
        Run C{work} under the lock.  A caller that gives up while queued leaves the
        queue; once C{work} has started it runs to its end (it may be terminating a
        worker) and holds the lock until then, whatever its caller does.
        """
        await self._lock.acquire()
        running = Deferred.fromCoroutine(work())
        running.addBoth(self._unlock)
        return await _shielded(running, self._orphaned)

    def _unlock(self, result: _T) -> _T:
        self._lock.release()
        return result

    def _orphaned(self, failure: Failure) -> None:
        if not failure.check(SpeechError):
            self.log.failure("residency work failed after its caller gave up", failure)

    async def _admit(self, ticket: _Ticket) -> Lease | None:
        """
        Grant C{ticket} a lease if it can have one now, evicting what it must; C{None}
        when it has to wait for a lease to end (why is left in C{ticket.blocked}).
        """
        while not ticket.gone:
            model = self._models.get(ticket.engine)
            if model is not None:
                if model.variant != ticket.variant:
                    if model.leases:
                        ticket.blocked = (
                            f'engine "{model.engine}" is speaking variant "{model.variant}" '
                            f'and cannot switch to "{ticket.variant}" until it finishes'
                        )
                        return None
                    # The worker swaps variants itself as it loads; it is still one model.
                    self.log.info("{engine}: variant {old} gives way to {new}",
                                  engine=model.engine, old=model.variant, new=ticket.variant)
                    model.variant = ticket.variant
                    model.size_bytes = None
                    model.measured = False
                    model.loaded = False
                    self._loading(model)
                return self._lease(model, ticket.keep_alive)
            if len(self._models) < self._settings.max_resident_models():
                model = _Model(ticket.engine, ticket.variant)
                self._models[ticket.engine] = model
                self._loading(model)
                return self._lease(model, ticket.keep_alive)
            idle = next((m for m in self._models.values() if m.leases == 0), None)
            if idle is None:
                speaking = ", ".join(self._models)
                ticket.blocked = (
                    f'engine "{ticket.engine}" needs room and every resident model is '
                    f"speaking ({speaking})"
                )
                return None
            self.log.info("evicting {engine} ({variant}) to make room for {wanted}",
                          engine=idle.engine, variant=idle.variant, wanted=ticket.engine)
            self._drop(idle, "room")
            await self._terminate_quietly(idle)
        return None

    async def _expire_now(self, model: _Model) -> None:
        if self._models.get(model.engine) is not model or model.leases:
            return
        keep_alive = self._keep_alive(model)
        if keep_alive < 0 or self._clock.seconds() < model.last_used + keep_alive:
            # A setting moved the deadline while this expiry waited for the lock.
            self._arm(model)
            return
        self.log.info("{engine} ({variant}) idle for {seconds} s: terminating its worker",
                      engine=model.engine, variant=model.variant, seconds=keep_alive)
        self._drop(model, "expired")
        await self._terminate_quietly(model)
        self._wake()

    async def _unload_now(self, engine: str, mode: str) -> None:
        model = self._models.get(engine)
        if model is not None and model.leases:
            raise Conflict(
                f'engine "{engine}" is speaking ({model.leases} in progress); '
                "unload it once it has finished",
            )
        if model is not None:
            self.log.info("{mode} {engine} ({variant}) on request",
                          mode=mode, engine=engine, variant=model.variant)
            self._drop(model, "unload")
        action = self._terminate if mode == "terminate" else self._unload
        try:
            await action(engine)
        finally:
            self._wake()

    def _drop(self, model: _Model, reason: str) -> None:
        del self._models[model.engine]
        model.disarm()
        if self.observer is not None:
            self.observer.evicted(model.engine, reason)

    def _loading(self, model: _Model) -> None:
        model.admitted = self._clock.seconds()
        if self.observer is not None:
            self.observer.load_started(model.engine, model.variant)

    async def _terminate_quietly(self, model: _Model) -> None:
        """
        Terminate an evicted or expired model's worker.  A failure is logged and the
        model stays forgotten: the supervisor's stop ends in SIGKILL, so the process
        is gone or going whatever the verb answered.
        """
        try:
            await self._terminate(model.engine)
        except Exception:
            self.log.failure("terminating {engine} failed", engine=model.engine)

    # -- leases, deadlines, waits ---------------------------------------------------------

    def _lease(self, model: _Model, keep_alive: int | None) -> Lease:
        # The last request to take a lease says how long the model stays; one that
        # says nothing puts the engine's own value back.
        model.asked = keep_alive
        model.leases += 1
        # An armed expiry is left to fire: it finds the model leased, or its deadline
        # moved on, and does nothing (a request in a steady stream of them costs no
        # timer to cancel and none to set).
        self._touch(model)
        return Lease(self, model)

    def _released(self, model: _Model) -> None:
        if model.server is not None:
            model.leases -= 1
            model.last_used = self._clock.seconds()
            return
        if self._models.get(model.engine) is not model:
            return  # its worker has gone since
        model.leases -= 1
        self._touch(model)
        if model.leases == 0:
            self._arm(model, lazily=True)
            self._wake()

    def _touch(self, model: _Model) -> None:
        model.last_used = self._clock.seconds()
        self._models.move_to_end(model.engine)

    def _keep_alive(self, model: _Model) -> int:
        if model.asked is not None:
            return model.asked
        own = self._settings.engine_keep_alive_seconds(model.engine)
        return own if own is not None else self._settings.keep_alive_seconds()

    def _arm(self, model: _Model, lazily: bool = False) -> None:
        """
        Set an idle model's deadline from when its last lease ended.  C{lazily}, an
        expiry already armed for no later than that is kept: when it fires it sees the
        deadline has moved and arms again for the rest.
        """
        keep_alive = self._keep_alive(model)
        if lazily and keep_alive >= 0 and model.expiry is not None and model.expiry.active():
            if model.expiry.getTime() <= model.last_used + keep_alive:
                return
        model.disarm()
        if keep_alive < 0:
            return
        delay = model.last_used + keep_alive - self._clock.seconds()
        if delay > 0:
            model.expiry = self._clock.callLater(delay, self._expire, model)
        else:
            self._expire(model)

    def _expire(self, model: _Model) -> None:
        model.expiry = None
        expiring = Deferred.fromCoroutine(self._exclusively(lambda: self._expire_now(model)))
        expiring.addErrback(lambda f: self.log.failure("expiring {engine} failed", f,
                                                       engine=model.engine))

    async def _wait_for_room(self, ticket: _Ticket) -> None:
        """
        Wait until something that could let C{ticket} in changes: a lease ends, a model
        goes, a setting changes.

        @raise ModelUnavailable: C{evictionWaitSeconds} after it first had to wait.
        """
        now = self._clock.seconds()
        if ticket.give_up_at is None:
            ticket.patience = self._settings.eviction_wait_seconds()
            ticket.give_up_at = now + ticket.patience
            self.log.info("waiting for room: {why}", why=ticket.blocked)
        gave_up = ModelUnavailable(
            f"{ticket.blocked}; none finished within {ticket.patience:g} s, try again"
        )
        remaining = ticket.give_up_at - now
        if remaining <= 0:
            raise gave_up
        changed: Deferred[bool] = Deferred()
        self._room.append(changed)
        timer = self._clock.callLater(remaining, changed.callback, False)
        try:
            if not await changed:
                raise gave_up
        finally:
            if timer.active():
                timer.cancel()
            if changed in self._room:
                self._room.remove(changed)

    def _wake(self) -> None:
        waiting, self._room = self._room, []
        for changed in waiting:
            # A waiter woken earlier in this loop may have cancelled one further on.
            if not changed.called:
                changed.callback(True)


def _shielded(running: Deferred[_T], orphaned: Callable[[Failure], None]) -> Deferred[_T]:
    """
    C{running}'s result, in a Deferred whose cancellation leaves C{running} to finish.
    A failure nobody is waiting for any more goes to C{orphaned}.
    """
    out: Deferred[_T] = Deferred()

    def deliver(result: _T | Failure) -> None:
        if out.called:
            if isinstance(result, Failure):
                orphaned(result)
        elif isinstance(result, Failure):
            out.errback(result)
        else:
            out.callback(result)

    running.addBoth(deliver)
    return out


def served_elsewhere_refusal(engine: str, served: dict[str, str]) -> Unsupported:
    """
    What an unload of an engine whose models are served elsewhere answers: there is
    nothing here to give back, and the server that holds them is not this core's.
    """
    where = ", ".join(f"{variant} on {server}" for variant, server in sorted(served.items()))
    return Unsupported(
        f'engine "{engine}" speaks through models served elsewhere ({where}); this server holds '
        "none of their memory and cannot unload them: the server that runs them does",
        field="engine",
    )
