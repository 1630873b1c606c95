"""
Management (protocol.md sections 9 and 10): the state database (L{state}), the settings
kept in it (L{settings}), install jobs and their event streams (L{jobs}, L{installer}),
the update check (L{update}) and the routes that serve them (L{routes}).
"""
